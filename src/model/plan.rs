//! What a ladder declares on the broker: every exchange, queue (with its arguments, per
//! broker version) and binding, in order. Declaring them is the broker wing's
//! (`broker::topology::apply`); this is only the list.
//!
//! Declaring is idempotent and never deletes: a changed delay is a new tier queue, and the
//! old one keeps dead-lettering into the due path until it is empty.

use std::fmt;

use crate::model::ladder::{DeadLetterStrategy, LadderSpec, QueueType, Tier};
use crate::model::names::{Names, Namespace};
use crate::model::protocol::header::{NEXT_PROBE, RETRY_LADDER, RETRY_NEXT};

/// One thing to declare on the broker.
#[derive(Debug, Clone, PartialEq)]
pub enum Declaration {
    /// A durable exchange.
    Exchange {
        /// Exchange name.
        name: String,
        /// `fanout`, `direct` or `headers`.
        kind: &'static str,
        /// Its arguments (`alternate-exchange`).
        args: Vec<(&'static str, ArgValue)>,
    },
    /// A durable queue with its arguments.
    Queue {
        /// Queue name.
        name: String,
        /// `x-…` arguments, in the order shown by `ladder plan`.
        args: Vec<(&'static str, ArgValue)>,
        /// The arguments an older Ladder (or an older broker) declared this queue with, if they
        /// differ. RabbitMQ cannot change a queue's arguments, so such a queue is kept, and
        /// [`apply`] says which policy adds what it lacks.
        ///
        /// [`apply`]: crate::broker::topology::apply
        older: Option<Vec<(&'static str, ArgValue)>>,
    },
    /// A binding of `queue` (or of the exchange of that name, `to_exchange`) to `exchange`
    /// with `key` and `args` (a headers exchange's match).
    Binding {
        /// Source exchange.
        exchange: String,
        /// Destination queue, or exchange when `to_exchange`.
        queue: String,
        /// Routing key (empty for fanout and headers).
        key: String,
        /// Binding arguments: `x-match` and the headers to match.
        args: Vec<(&'static str, ArgValue)>,
        /// The destination is an exchange (RabbitMQ's exchange-to-exchange binding).
        to_exchange: bool,
    },
    /// A binding an earlier Ladder declared that this one removes: `exchange` to the queue
    /// (or exchange, `to_exchange`) `queue` with `key` and `args`. Removing one that does not
    /// exist, or one whose queue does not exist, is no error.
    Unbinding {
        /// Source exchange.
        exchange: String,
        /// Destination queue, or exchange when `to_exchange`.
        queue: String,
        /// Routing key.
        key: String,
        /// Binding arguments (a headers exchange's match).
        args: Vec<(&'static str, ArgValue)>,
        /// The destination is an exchange.
        to_exchange: bool,
    },
}

/// A queue argument value: a string or an integer.
#[derive(Debug, Clone, PartialEq)]
pub enum ArgValue {
    /// Sent as a long string.
    Str(String),
    /// Sent as a signed 64-bit integer.
    Int(i64),
    /// Sent as a boolean.
    Bool(bool),
    /// Sent as a void field: in a headers binding, matches any value of the header (its
    /// presence).
    Void,
}

fn write_args(f: &mut fmt::Formatter<'_>, args: &[(&'static str, ArgValue)]) -> fmt::Result {
    for (key, value) in args {
        match value {
            ArgValue::Str(s) => write!(f, " {key}={s}")?,
            ArgValue::Int(i) => write!(f, " {key}={i}")?,
            ArgValue::Bool(b) => write!(f, " {key}={b}")?,
            ArgValue::Void => write!(f, " {key}=*")?,
        }
    }
    Ok(())
}

impl fmt::Display for Declaration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Declaration::Exchange { name, kind, args } => {
                write!(f, "exchange {name} type={kind} durable")?;
                write_args(f, args)
            }
            Declaration::Queue { name, args, .. } => {
                write!(f, "queue    {name} durable")?;
                write_args(f, args)
            }
            Declaration::Binding {
                exchange,
                queue,
                key,
                args,
                to_exchange,
            } => {
                let what = if *to_exchange { "exchange " } else { "" };
                write!(f, "binding  {exchange} -> {what}{queue} key={key:?}")?;
                write_args(f, args)
            }
            Declaration::Unbinding {
                exchange,
                queue,
                key,
                args,
                to_exchange,
            } => {
                let what = if *to_exchange { "exchange " } else { "" };
                write!(f, "unbind   {exchange} -> {what}{queue} key={key:?}")?;
                write_args(f, args)
            }
        }
    }
}

/// A RabbitMQ version, as its `connection.start` says (`version` server property).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BrokerVersion(pub u32, pub u32, pub u32);

impl BrokerVersion {
    /// The newest version the plan is written for when no broker is asked (`ladder plan`).
    pub const LATEST: BrokerVersion = BrokerVersion(4, 3, 0);

    /// 4.0 and later: quorum queues have a default delivery limit of 20.
    fn quorum_delivery_limit_by_default(self) -> bool {
        self >= BrokerVersion(4, 0, 0)
    }
}

impl BrokerVersion {
    /// The version in a broker's `(major, minor, patch)`, the latest if it does not say.
    pub fn from_server(version: Option<(u32, u32, u32)>) -> BrokerVersion {
        version.map_or(BrokerVersion::LATEST, |(a, b, c)| BrokerVersion(a, b, c))
    }
}

impl fmt::Display for BrokerVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// How many times a delivery may return to `N.L.intake` or `N.L.due` before the broker
/// dead-letters it into the ladder's quarantine, which parks it; a lost connection counts as a
/// return. Only a broker or network in trouble returns a delivery, so 100 survives any realistic
/// run of reconnects. On 4.3 a message dead-lettered into the ladder already carries its source
/// queue's count (up to 20 by default). A loop that keeps failing on one message still ends in
/// the parking lot.
pub const DELIVERY_LIMIT: i64 = 100;

/// Everything the service declares for `ladders` in `namespace` on a broker of `version`, in
/// an order that declares before binding.
pub fn plan(namespace: &str, ladders: &[LadderSpec], version: BrokerVersion) -> Vec<Declaration> {
    let mut out = plan_shared(namespace, ladders, version);
    out.extend(
        ladders
            .iter()
            .flat_map(|spec| plan_ladder(&Names::of(namespace, spec), spec, version)),
    );
    out
}

/// What the ladders of `namespace` share: its topology stream, the tier queues (one per delay
/// and [`Names::tier_family`], however many ladders use it), `N.due` that routes what expires
/// in them to its own ladder, and `N.stray` for what belongs to none.
pub fn plan_shared(namespace: &str, ladders: &[LadderSpec], version: BrokerVersion) -> Vec<Declaration> {
    let shared = Namespace::new(namespace);
    let mut stray_args = vec![("x-queue-type", ArgValue::Str("quorum".into()))];
    if version.quorum_delivery_limit_by_default() {
        stray_args.push(("x-delivery-limit", ArgValue::Int(-1)));
    }
    let mut out = vec![
        topology_stream(namespace),
        exchange(&shared.stray, "fanout", None),
        Declaration::Queue {
            name: shared.stray.clone(),
            args: stray_args,
            older: None,
        },
        bind(&shared.stray, &shared.stray, "", false),
        exchange(&shared.due, "headers", Some(&shared.stray)),
        watchdog_queue(namespace),
    ];
    for spec in ladders {
        let names = Names::of(namespace, spec);
        for tier in &spec.tiers {
            let queue = Declaration::Queue {
                name: names.tier_queue(tier),
                args: tier_args(&names, spec, tier),
                older: None,
            };
            if !out.contains(&queue) {
                out.push(queue);
            }
        }
    }
    out
}

/// `N.watchdog`, where the session's watchdog publishes its heartbeat (`broker::watchdog`). It
/// is a quorum queue whatever the ladders' queue type, because only a replicated write tells a
/// node that reaches its cluster from one that does not. It keeps at most one message, and
/// nobody consumes it.
pub fn watchdog_queue(namespace: &str) -> Declaration {
    Declaration::Queue {
        name: Namespace::new(namespace).watchdog,
        args: vec![
            ("x-queue-type", ArgValue::Str("quorum".into())),
            ("x-max-length", ArgValue::Int(1)),
        ],
        older: None,
    }
}

/// `N.topology`, the namespace's record of what it declared (`model::drift`): a stream kept by
/// size, each record holding everything known, so the newest alone is enough.
pub fn topology_stream(namespace: &str) -> Declaration {
    Declaration::Queue {
        name: Namespace::new(namespace).topology,
        args: vec![
            ("x-queue-type", ArgValue::Str("stream".into())),
            ("x-max-length-bytes", ArgValue::Int(TOPOLOGY_MAX_BYTES)),
            ("x-stream-max-segment-size-bytes", ArgValue::Int(HOLDS_SEGMENT_BYTES)),
        ],
        older: None,
    }
}

/// The topology stream's retention: a record of ten ladders is some 40 KiB, and one is written
/// only when a plan adds something.
pub const TOPOLOGY_MAX_BYTES: i64 = 8 * 1024 * 1024;

/// The binding of `exchange` (`N.L`) that routes a failure whose `retry-next` is `value` of
/// `ladder` into `queue`.
pub(crate) fn route(exchange: &str, queue: &str, ladder: &str, value: &str) -> Declaration {
    Declaration::Binding {
        exchange: exchange.into(),
        queue: queue.into(),
        key: String::new(),
        args: next_match(ladder, value),
        to_exchange: false,
    }
}

/// The match of a routing binding of `N.L`: `retry-ladder` and `retry-next`.
pub(crate) fn next_match(ladder: &str, value: &str) -> Vec<(&'static str, ArgValue)> {
    vec![
        ("x-match", ArgValue::Str("all".into())),
        (RETRY_LADDER, ArgValue::Str(ladder.into())),
        (RETRY_NEXT, ArgValue::Str(value.into())),
    ]
}

/// The declarations of one ladder (README "How a retry travels"). `N.L` is a headers exchange:
/// it routes a repeat failure by its `retry-next` straight into its tier, and the rest through
/// its alternate exchange `N.L.intake` to the intake queue. Then come the quarantine, the queues
/// the hops consume and the streams. They are declared from the end back, so each alternate
/// exchange exists before anything can fall into it.
pub fn plan_ladder(names: &Names, spec: &LadderSpec, version: BrokerVersion) -> Vec<Declaration> {
    let mut out = vec![
        exchange(&names.quarantine, "fanout", None),
        quarantine_queue(names, spec, version),
        bind(&names.quarantine, &names.quarantine, "", false),
        netted_queue(&names.intake_queue, names, spec, Some(vec![queue_type(spec)])),
        netted_queue(&names.probes, names, spec, None),
        netted_queue(&names.due, names, spec, Some(vec![queue_type(spec)])),
        // what expires in a shared tier comes due here when it is this ladder's
        Declaration::Binding {
            exchange: names.namespace.due.clone(),
            queue: names.due.clone(),
            key: String::new(),
            args: vec![
                ("x-match", ArgValue::Str("all".into())),
                (RETRY_LADDER, ArgValue::Str(spec.name.clone())),
            ],
            to_exchange: false,
        },
        exchange(&names.intake_exchange, "fanout", None),
        bind(&names.intake_exchange, &names.intake_queue, "", false),
        exchange(&names.exchange, "headers", Some(&names.intake_exchange)),
    ];
    out.extend(routes(names, spec, &names.exchange));
    out.extend(streams(names, spec));
    out
}

/// The bindings of `exchange` that route a repeat failure past the intake: into the tier of
/// each step, and to the probes queue. `exchange` is `N.L`, or the headers exchange behind it on
/// a ladder upgraded from an older layout. A jittered ladder has no step bindings, as its intake
/// draws every delay. `retry-next: intake` needs none: what no binding matches goes to the intake, and
/// every binding costs each failure a match.
fn routes(names: &Names, spec: &LadderSpec, exchange: &str) -> Vec<Declaration> {
    let mut out = Vec::new();
    if spec.spread().is_none() {
        out.extend(
            spec.steps
                .iter()
                .map(|tier| route(exchange, &names.tier_queue(tier), &spec.name, &tier.name)),
        );
    }
    out.push(route(exchange, &names.probes, &spec.name, NEXT_PROBE));
    out
}

/// The unbinds of the step routes of `exchange` when the ladder has `jitter`: a ladder that
/// gained it since must not let a repeat failure skip the intake's draw. Nothing otherwise.
pub fn retired_routes(names: &Names, spec: &LadderSpec, exchange: &str) -> Vec<Declaration> {
    if spec.spread().is_none() {
        return Vec::new();
    }
    spec.steps
        .iter()
        .map(|tier| {
            unbind(
                exchange,
                &names.tier_queue(tier),
                "",
                next_match(&spec.name, &tier.name),
                false,
            )
        })
        .collect()
}

/// A durable exchange of `kind`, with `alternate` as its alternate exchange if any.
pub(crate) fn exchange(name: &str, kind: &'static str, alternate: Option<&str>) -> Declaration {
    Declaration::Exchange {
        name: name.into(),
        kind,
        args: alternate
            .map(|a| vec![("alternate-exchange", ArgValue::Str(a.into()))])
            .unwrap_or_default(),
    }
}

/// A binding without arguments of `to` (a queue, or an exchange when `to_exchange`) to
/// `exchange` with `key`.
pub(crate) fn bind(exchange: &str, to: &str, key: &str, to_exchange: bool) -> Declaration {
    Declaration::Binding {
        exchange: exchange.into(),
        queue: to.into(),
        key: key.into(),
        args: Vec::new(),
        to_exchange,
    }
}

/// The removal of a binding of `queue` (an exchange when `to_exchange`) to `exchange`.
pub(crate) fn unbind(
    exchange: &str,
    queue: &str,
    key: &str,
    args: Vec<(&'static str, ArgValue)>,
    to_exchange: bool,
) -> Declaration {
    Declaration::Unbinding {
        exchange: exchange.into(),
        queue: queue.into(),
        key: key.into(),
        args,
        to_exchange,
    }
}

fn queue_type(spec: &LadderSpec) -> (&'static str, ArgValue) {
    ("x-queue-type", ArgValue::Str(spec.queue_type.as_str().into()))
}

/// A queue a hop consumes: it dead-letters into the quarantine after [`DELIVERY_LIMIT`] returns
/// (quorum). `older` is its shape before it had that net.
fn netted_queue(
    name: &str,
    names: &Names,
    spec: &LadderSpec,
    older: Option<Vec<(&'static str, ArgValue)>>,
) -> Declaration {
    let mut args = vec![
        queue_type(spec),
        ("x-dead-letter-exchange", ArgValue::Str(names.quarantine.clone())),
    ];
    if spec.queue_type == QueueType::Quorum {
        args.push(("x-delivery-limit", ArgValue::Int(DELIVERY_LIMIT)));
    }
    Declaration::Queue {
        name: name.into(),
        args,
        older,
    }
}

/// The quarantine, the last stop: no delivery limit (4.x would impose 20), which 3.x declared
/// without.
fn quarantine_queue(names: &Names, spec: &LadderSpec, version: BrokerVersion) -> Declaration {
    let mut args = vec![queue_type(spec)];
    if spec.queue_type == QueueType::Quorum && version.quorum_delivery_limit_by_default() {
        args.push(("x-delivery-limit", ArgValue::Int(-1)));
    }
    let older = (args.len() > 1).then(|| vec![queue_type(spec)]);
    Declaration::Queue {
        name: names.quarantine.clone(),
        args,
        older,
    }
}

/// The ladder's streams: the parking lot, the cancellations and the holds. Cancellations exist
/// only with delay levels, and are kept 49 days, the longest wait. Holds are kept by size, as a
/// hold lasts until it is resumed; the followers' checkpoints keep every live one.
fn streams(names: &Names, spec: &LadderSpec) -> Vec<Declaration> {
    let stream = ("x-queue-type", ArgValue::Str("stream".into()));
    let mut out = vec![Declaration::Queue {
        name: names.parked.clone(),
        args: vec![stream.clone()],
        older: None,
    }];
    if spec.exact_delays {
        out.push(Declaration::Queue {
            name: names.cancels.clone(),
            args: vec![stream.clone(), ("x-max-age", ArgValue::Str(CANCELS_MAX_AGE.into()))],
            older: None,
        });
    }
    out.push(Declaration::Queue {
        name: names.holds.clone(),
        args: vec![
            stream.clone(),
            ("x-max-length-bytes", ArgValue::Int(HOLDS_MAX_BYTES)),
            ("x-stream-max-segment-size-bytes", ArgValue::Int(HOLDS_SEGMENT_BYTES)),
        ],
        // declared without a retention by earlier releases: kept, and the policy that adds it shown
        older: Some(vec![stream]),
    });
    out
}

/// The arguments of a queue where messages wait `tier`: its TTL, and dead-lettering into `N.due`,
/// which routes each message to its own ladder's due queue. Its queue type and dead-letter
/// strategy are the same for every ladder of its [`Names::tier_family`], so they share it.
fn tier_args(names: &Names, spec: &LadderSpec, tier: &Tier) -> Vec<(&'static str, ArgValue)> {
    let mut args = vec![
        ("x-queue-type", ArgValue::Str(spec.queue_type.as_str().into())),
        ("x-message-ttl", ArgValue::Int(tier.ttl_ms() as i64)),
        ("x-dead-letter-exchange", ArgValue::Str(names.namespace.due.clone())),
    ];
    match (spec.queue_type, spec.dead_letter_strategy) {
        (QueueType::Quorum, DeadLetterStrategy::AtLeastOnce) => {
            args.push(("x-dead-letter-strategy", ArgValue::Str("at-least-once".into())));
            // at-least-once dead-lettering requires it
            args.push(("x-overflow", ArgValue::Str("reject-publish".into())));
        }
        (QueueType::Classic, _) if tier.delay.as_secs() >= LAZY_TIER_SECS => {
            // a long classic tier holds many messages; keep them on disk, not in memory
            args.push(("x-queue-mode", ArgValue::Str("lazy".into())));
        }
        _ => {}
    }
    args
}

/// The held queue of `destination` (`N.L.held.<destination>`). It is declared when the
/// destination is first held, never on the hot path, and by every replica that reads the hold
/// before its due hop may route into it. Like the due queue it dead-letters into the quarantine
/// past [`DELIVERY_LIMIT`] returns. It has no TTL, so the oldest is released first. It takes one
/// active consumer at a time, so however many replicas release it, the release rate is one's.
pub fn held_queue(names: &Names, spec: &LadderSpec, destination: &str) -> Declaration {
    let mut args = vec![
        ("x-queue-type", ArgValue::Str(spec.queue_type.as_str().into())),
        ("x-dead-letter-exchange", ArgValue::Str(names.quarantine.clone())),
        ("x-single-active-consumer", ArgValue::Bool(true)),
    ];
    if spec.queue_type == QueueType::Quorum {
        args.push(("x-delivery-limit", ArgValue::Int(DELIVERY_LIMIT)));
    }
    Declaration::Queue {
        name: names.held_queue(destination),
        args,
        older: None,
    }
}

/// The hold stream's retention: the broker removes its oldest segments past this size. It keeps
/// at least this less one segment (7 MiB, some 25 000 hold records), far more than the
/// `model::holds::CHECKPOINT_EVERY_BYTES` (1 to 1.5 MiB) between two checkpoints, so the
/// retained part always begins within what a checkpoint covers.
pub const HOLDS_MAX_BYTES: i64 = 8 * 1024 * 1024;

/// The hold stream's segment size: retention removes whole segments, and the broker's default
/// (500 MB) would keep everything.
pub const HOLDS_SEGMENT_BYTES: i64 = 1024 * 1024;

/// How long the cancellation stream keeps a record: a day more than the longest delay.
pub const CANCELS_MAX_AGE: &str = "50D";

/// Classic tiers at least this long are lazy: 1 000 000 waiting messages cost +48 MB of broker
/// memory lazy versus +3.5 GB in the default mode (shared/DESIGN.md).
const LAZY_TIER_SECS: u64 = 60;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn spec(queue_type: QueueType, strategy: DeadLetterStrategy) -> LadderSpec {
        LadderSpec::new(
            "orders".into(),
            vec![Duration::from_secs(10), Duration::from_secs(3600)],
            3,
            regex::RegexSet::new(["^x$"]).unwrap(),
            queue_type,
            strategy,
        )
    }

    #[test]
    fn quorum_tiers_dead_letter_at_least_once_into_due() {
        let s = spec(QueueType::Quorum, DeadLetterStrategy::AtLeastOnce);
        let plan: Vec<String> = plan("ns", std::slice::from_ref(&s), BrokerVersion::LATEST)
            .iter()
            .map(|d| d.to_string())
            .collect();
        let tier = plan.iter().find(|l| l.contains("queue    ns.delay.10s")).unwrap();
        assert_eq!(
            tier,
            "queue    ns.delay.10s durable x-queue-type=quorum x-message-ttl=10000 \
             x-dead-letter-exchange=ns.due x-dead-letter-strategy=at-least-once x-overflow=reject-publish"
        );
        // what expires in a shared tier comes due in its own ladder; the rest is kept as stray
        for line in [
            "exchange ns.due type=headers durable alternate-exchange=ns.stray",
            "binding  ns.due -> ns.orders.due key=\"\" x-match=all retry-ladder=orders",
            "exchange ns.stray type=fanout durable",
            "binding  ns.stray -> ns.stray key=\"\"",
        ] {
            assert!(plan.contains(&line.to_string()), "{line}\n{plan:#?}");
        }
        assert!(plan.contains(&"queue    ns.orders.parked durable x-queue-type=stream".to_string()));
        // a failure's way in: N.L routes a repeat failure, its alternate N.L.intake the rest
        for line in [
            "exchange ns.orders.intake type=fanout durable",
            "binding  ns.orders.intake -> ns.orders.intake key=\"\"",
            "exchange ns.orders type=headers durable alternate-exchange=ns.orders.intake",
            "binding  ns.orders -> ns.delay.10s key=\"\" x-match=all retry-ladder=orders retry-next=10s",
            "binding  ns.orders -> ns.delay.1h key=\"\" x-match=all retry-ladder=orders retry-next=1h",
            "binding  ns.orders -> ns.orders.probes key=\"\" x-match=all retry-ladder=orders retry-next=probe",
        ] {
            assert!(plan.contains(&line.to_string()), "{line}\n{plan:#?}");
        }
        let at = |line: &str| plan.iter().position(|l| l == line).unwrap();
        // an alternate exchange is bound before anything can fall into it
        assert!(
            at("binding  ns.orders.intake -> ns.orders.intake key=\"\"")
                < at("exchange ns.orders type=headers durable alternate-exchange=ns.orders.intake")
        );
        // three exchanges per ladder, and nothing of an older layout
        let exchanges: Vec<&String> = plan.iter().filter(|l| l.starts_with("exchange ns.orders")).collect();
        assert_eq!(exchanges.len(), 3, "{exchanges:#?}");
        for old in [
            ".next",
            ".first",
            ".sort",
            ".wait",
            ".tiers",
            "unbind",
            "ns.orders.due type",
        ] {
            assert!(!plan.iter().any(|l| l.contains(old)), "{old}: {plan:#?}");
        }
    }

    #[test]
    fn ladders_of_a_namespace_share_their_tiers_and_another_ladder_adds_few_queues() {
        let queues = |ladders: &[LadderSpec]| {
            plan("ns", ladders, BrokerVersion::LATEST)
                .iter()
                .filter_map(|d| match d {
                    Declaration::Queue { name, .. } => Some(name.clone()),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        let mut a = spec(QueueType::Quorum, DeadLetterStrategy::AtLeastOnce);
        a.name = "a".into();
        let mut b = a.clone();
        b.name = "b".into();
        let one = queues(std::slice::from_ref(&a));
        let two = queues(&[a.clone(), b.clone()]);
        let added: Vec<&String> = two.iter().filter(|q| !one.contains(q)).collect();
        // intake, probes, due, quarantine, parked, cancels, holds: no tier and no level again
        assert_eq!(added.len(), 7, "{added:?}");
        assert!(added.iter().all(|q| q.starts_with("ns.b.")), "{added:?}");
        let unique: std::collections::BTreeSet<&String> = two.iter().collect();
        assert_eq!(unique.len(), two.len(), "each queue is declared once");
        // a ladder whose tiers take other arguments has its own
        let mut c = spec(QueueType::Classic, DeadLetterStrategy::AtMostOnce);
        c.name = "c".into();
        let three = queues(&[a, b, c]);
        assert!(three.contains(&"ns.delay.10s.classic".to_string()), "{three:?}");
    }

    #[test]
    fn with_jitter_every_failure_goes_through_the_intake() {
        let mut s = spec(QueueType::Quorum, DeadLetterStrategy::AtLeastOnce);
        s.set_exact_delays(true);
        s.jitter = Some(crate::model::ladder::Jitter { permille: 200 });
        // no delivery names a tier: the intake draws each delay
        assert_eq!(s.next_route(1), None);
        let plain = spec(QueueType::Quorum, DeadLetterStrategy::AtLeastOnce);
        assert_eq!(plain.next_route(1).map(|t| t.name.as_str()), Some("1h"));
        assert_eq!(plain.next_route(3), None, "its next failure would exhaust the ladder");
        // and N.L routes none of its steps: a forged retry-next falls through to the intake,
        // which draws
        let lines: Vec<String> = plan_ladder(&Names::of("ns", &s), &s, BrokerVersion::LATEST)
            .iter()
            .map(|d| d.to_string())
            .collect();
        for tier in ["10s", "1h"] {
            let route =
                format!("ns.orders -> ns.delay.{tier} key=\"\" x-match=all retry-ladder=orders retry-next={tier}");
            assert!(!lines.iter().any(|l| l.contains(&route)), "{lines:#?}");
        }
        // retry-next: intake has no binding: N.L's alternate takes it to the intake
        assert!(!lines.iter().any(|l| l.contains("retry-next=intake")), "{lines:#?}");
        assert!(
            lines.contains(&"exchange ns.orders type=headers durable alternate-exchange=ns.orders.intake".to_string())
        );
    }

    #[test]
    fn intake_and_due_dead_letter_into_a_quarantine_without_a_delivery_limit() {
        let s = spec(QueueType::Quorum, DeadLetterStrategy::AtLeastOnce);
        let lines = |version| -> Vec<String> {
            plan_ladder(&Names::of("ns", &s), &s, version)
                .iter()
                .map(|d| d.to_string())
                .collect()
        };
        for version in [BrokerVersion(3, 10, 8), BrokerVersion(4, 0, 5), BrokerVersion(4, 3, 6)] {
            let plan = lines(version);
            for queue in ["intake", "due"] {
                let want = format!(
                    "queue    ns.orders.{queue} durable x-queue-type=quorum \
                     x-dead-letter-exchange=ns.orders.quarantine x-delivery-limit={DELIVERY_LIMIT}"
                );
                assert!(plan.contains(&want), "{version}: {plan:#?}");
            }
            let quarantine = plan
                .iter()
                .position(|l| l.starts_with("queue    ns.orders.quarantine"))
                .unwrap();
            let intake = plan
                .iter()
                .position(|l| l.starts_with("queue    ns.orders.intake"))
                .unwrap();
            assert!(quarantine < intake, "the net exists before what falls into it");
            assert!(plan.contains(&"binding  ns.orders.quarantine -> ns.orders.quarantine key=\"\"".to_string()));
        }
        // 4.x would limit the quarantine to 20 deliveries: it says unlimited; 3.x has no limit
        assert!(
            lines(BrokerVersion(4, 0, 5))
                .contains(&"queue    ns.orders.quarantine durable x-queue-type=quorum x-delivery-limit=-1".to_string())
        );
        assert!(
            lines(BrokerVersion(3, 10, 8))
                .contains(&"queue    ns.orders.quarantine durable x-queue-type=quorum".to_string())
        );
        // classic queues have no delivery limit: only the dead-letter exchange
        let classic = spec(QueueType::Classic, DeadLetterStrategy::AtMostOnce);
        let plan: Vec<String> = plan_ladder(&Names::of("ns", &classic), &classic, BrokerVersion::LATEST)
            .iter()
            .map(|d| d.to_string())
            .collect();
        assert!(
            plan.contains(
                &"queue    ns.orders.intake durable x-queue-type=classic x-dead-letter-exchange=ns.orders.quarantine"
                    .to_string()
            ),
            "{plan:#?}"
        );
    }

    #[test]
    fn classic_long_tiers_are_lazy_and_short_ones_are_not() {
        let s = spec(QueueType::Classic, DeadLetterStrategy::AtMostOnce);
        let plan = plan("ns", std::slice::from_ref(&s), BrokerVersion::LATEST);
        let args_of = |name: &str| {
            plan.iter()
                .find_map(|d| match d {
                    Declaration::Queue { name: n, args, .. } if n == name => Some(args.clone()),
                    _ => None,
                })
                .unwrap()
        };
        assert!(args_of("ns.delay.1h.classic").contains(&("x-queue-mode", ArgValue::Str("lazy".into()))));
        assert!(
            !args_of("ns.delay.10s.classic")
                .iter()
                .any(|(k, _)| *k == "x-queue-mode")
        );
        assert!(
            !args_of("ns.delay.10s.classic")
                .iter()
                .any(|(k, _)| *k == "x-dead-letter-strategy")
        );
    }
}
