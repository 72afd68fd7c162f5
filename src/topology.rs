//! The names and declarations every ladder owns on the broker — a contract other tools and
//! languages rely on — and the one function that declares them.
//!
//! Declaring is idempotent and never deletes: a changed delay is a new tier queue, and the
//! old one keeps dead-lettering into the due path until it is empty.

use std::fmt;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, ExchangeKind};

use crate::config::Config;
use crate::ladder::{DeadLetterStrategy, LadderSpec, QueueType, Tier};

/// The names of one ladder's exchanges and queues, for namespace `N` and ladder `L`.
#[derive(Debug, Clone)]
pub struct Names {
    /// `N.` — every name of the namespace starts with this.
    pub prefix: String,
    /// `N.L`: the fanout intake exchange consumers publish or dead-letter to.
    pub intake_exchange: String,
    /// `N.L.intake`: the queue the service consumes failures from.
    pub intake_queue: String,
    /// `N.L.tiers`: the direct exchange routing by tier name.
    pub tiers_exchange: String,
    /// `N.L.due`: the fanout exchange and the queue of expired messages.
    pub due: String,
    /// `N.L.parked`: the parking-lot stream.
    pub parked: String,
}

impl Names {
    /// Names for ladder `ladder` in namespace `namespace`.
    pub fn new(namespace: &str, ladder: &str) -> Self {
        let base = format!("{namespace}.{ladder}");
        Names {
            prefix: format!("{namespace}."),
            intake_queue: format!("{base}.intake"),
            tiers_exchange: format!("{base}.tiers"),
            due: format!("{base}.due"),
            parked: format!("{base}.parked"),
            intake_exchange: base,
        }
    }

    /// `N.L.delay.<tier>`.
    pub fn tier_queue(&self, tier: &Tier) -> String {
        format!("{}.delay.{}", self.intake_exchange, tier.name)
    }

    /// Every queue of the ladder with its role, the `queue` label of `ladder_queue_messages`:
    /// `intake`, `due`, `parked`, then `delay.<tier>` shortest first.
    pub fn queues(&self, spec: &LadderSpec) -> Vec<(String, String)> {
        let mut queues = vec![
            ("intake".to_string(), self.intake_queue.clone()),
            ("due".to_string(), self.due.clone()),
            ("parked".to_string(), self.parked.clone()),
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

/// One thing to declare on the broker.
#[derive(Debug, Clone, PartialEq)]
pub enum Declaration {
    /// A durable exchange.
    Exchange {
        /// Exchange name.
        name: String,
        /// `fanout` or `direct`.
        kind: &'static str,
    },
    /// A durable queue with its arguments.
    Queue {
        /// Queue name.
        name: String,
        /// `x-…` arguments, in the order shown by `ladder plan`.
        args: Vec<(&'static str, ArgValue)>,
    },
    /// A binding of `queue` to `exchange` with `key`.
    Binding {
        /// Source exchange.
        exchange: String,
        /// Destination queue.
        queue: String,
        /// Routing key (empty for fanout).
        key: String,
    },
}

/// A queue argument value: a string or an integer.
#[derive(Debug, Clone, PartialEq)]
pub enum ArgValue {
    /// Sent as a long string.
    Str(String),
    /// Sent as a signed 64-bit integer.
    Int(i64),
}

impl fmt::Display for Declaration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Declaration::Exchange { name, kind } => write!(f, "exchange {name} type={kind} durable"),
            Declaration::Queue { name, args } => {
                write!(f, "queue    {name} durable")?;
                for (key, value) in args {
                    match value {
                        ArgValue::Str(s) => write!(f, " {key}={s}")?,
                        ArgValue::Int(i) => write!(f, " {key}={i}")?,
                    }
                }
                Ok(())
            }
            Declaration::Binding { exchange, queue, key } => {
                write!(f, "binding  {exchange} -> {queue} key={key:?}")
            }
        }
    }
}

/// Everything the service declares for `config`, in an order that declares before binding.
pub fn plan(config: &Config) -> Vec<Declaration> {
    config
        .ladders
        .iter()
        .flat_map(|spec| plan_ladder(&Names::new(&config.namespace, &spec.name), spec))
        .collect()
}

/// The declarations of one ladder.
pub fn plan_ladder(names: &Names, spec: &LadderSpec) -> Vec<Declaration> {
    let exchange = |name: &str, kind| Declaration::Exchange {
        name: name.into(),
        kind,
    };
    let bind = |exchange: &str, queue: &str, key: &str| Declaration::Binding {
        exchange: exchange.into(),
        queue: queue.into(),
        key: key.into(),
    };
    let queue_type = ("x-queue-type", ArgValue::Str(spec.queue_type.as_str().into()));

    let mut out = vec![
        exchange(&names.intake_exchange, "fanout"),
        Declaration::Queue {
            name: names.intake_queue.clone(),
            args: vec![queue_type.clone()],
        },
        bind(&names.intake_exchange, &names.intake_queue, ""),
        exchange(&names.tiers_exchange, "direct"),
        exchange(&names.due, "fanout"),
        Declaration::Queue {
            name: names.due.clone(),
            args: vec![queue_type.clone()],
        },
        bind(&names.due, &names.due, ""),
    ];
    for tier in &spec.tiers {
        let queue = names.tier_queue(tier);
        let mut args = vec![
            queue_type.clone(),
            ("x-message-ttl", ArgValue::Int(tier.ttl_ms() as i64)),
            ("x-dead-letter-exchange", ArgValue::Str(names.due.clone())),
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
        out.push(Declaration::Queue {
            name: queue.clone(),
            args,
        });
        out.push(bind(&names.tiers_exchange, &queue, &tier.name));
    }
    out.push(Declaration::Queue {
        name: names.parked.clone(),
        args: vec![("x-queue-type", ArgValue::Str("stream".into()))],
    });
    out
}

/// Classic tiers at least this long are lazy: 1 000 000 waiting messages cost +48 MB of broker
/// memory lazy versus +3.5 GB in the default mode (shared/DESIGN.md).
const LAZY_TIER_SECS: u64 = 60;

/// Declaring failed.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// An existing exchange or queue has other arguments; the broker refuses to change them.
    #[error(
        "{declaration}: exists on the broker with other arguments ({detail}); tier queues are immutable, so change the delay (a new tier) or delete the old object once it is empty"
    )]
    Conflict {
        /// What we tried to declare.
        declaration: String,
        /// The broker's words.
        detail: String,
    },
    /// The connection or channel failed; retry after reconnecting.
    #[error("declaring {declaration}: {source}")]
    Broker {
        /// What we tried to declare.
        declaration: String,
        /// The client's error.
        #[source]
        source: lapin::Error,
    },
}

/// Declares `declarations` in order on `channel`.
///
/// A precondition failure closes the channel, so the first conflict ends the run.
pub async fn apply(channel: &Channel, declarations: &[Declaration]) -> Result<(), TopologyError> {
    for declaration in declarations {
        declare(channel, declaration).await.map_err(|source| {
            let text = declaration.to_string();
            match precondition_detail(&source) {
                Some(detail) => TopologyError::Conflict {
                    declaration: text,
                    detail,
                },
                None => TopologyError::Broker {
                    declaration: text,
                    source,
                },
            }
        })?;
    }
    Ok(())
}

async fn declare(channel: &Channel, declaration: &Declaration) -> lapin::Result<()> {
    match declaration {
        Declaration::Exchange { name, kind } => {
            let kind = match *kind {
                "fanout" => ExchangeKind::Fanout,
                _ => ExchangeKind::Direct,
            };
            let options = ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            };
            channel
                .exchange_declare(name.as_str().into(), kind, options, FieldTable::default())
                .await
        }
        Declaration::Queue { name, args } => {
            let mut table = FieldTable::default();
            for (key, value) in args {
                let value = match value {
                    ArgValue::Str(s) => AMQPValue::LongString(LongString::from(s.as_bytes())),
                    ArgValue::Int(i) => AMQPValue::LongLongInt(*i),
                };
                table.insert(ShortString::from(*key), value);
            }
            let options = QueueDeclareOptions {
                durable: true,
                ..Default::default()
            };
            channel
                .queue_declare(name.as_str().into(), options, table)
                .await
                .map(|_| ())
        }
        Declaration::Binding { exchange, queue, key } => {
            channel
                .queue_bind(
                    queue.as_str().into(),
                    exchange.as_str().into(),
                    key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
        }
    }
}

/// The broker's text if `error` is a 406 PRECONDITION_FAILED channel close.
fn precondition_detail(error: &lapin::Error) -> Option<String> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 406 => Some(amqp.get_message().to_string()),
        _ => None,
    }
}

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
    fn names_follow_the_contract() {
        let n = Names::new("ns", "orders");
        assert_eq!(n.intake_exchange, "ns.orders");
        assert_eq!(n.intake_queue, "ns.orders.intake");
        assert_eq!(n.tiers_exchange, "ns.orders.tiers");
        assert_eq!(n.due, "ns.orders.due");
        assert_eq!(n.parked, "ns.orders.parked");
        assert_eq!(
            n.tier_queue(&Tier::new(Duration::from_millis(5_400_000))),
            "ns.orders.delay.1h30m"
        );
        let s = spec(QueueType::Quorum, DeadLetterStrategy::AtLeastOnce);
        let queues = n.queues(&s);
        let roles: Vec<(&str, &str)> = queues.iter().map(|(r, q)| (r.as_str(), q.as_str())).collect();
        assert_eq!(
            roles,
            [
                ("intake", "ns.orders.intake"),
                ("due", "ns.orders.due"),
                ("parked", "ns.orders.parked"),
                ("delay.10s", "ns.orders.delay.10s"),
                ("delay.1h", "ns.orders.delay.1h"),
            ]
        );
    }

    #[test]
    fn quorum_tiers_dead_letter_at_least_once_into_due() {
        let s = spec(QueueType::Quorum, DeadLetterStrategy::AtLeastOnce);
        let plan: Vec<String> = plan_ladder(&Names::new("ns", "orders"), &s)
            .iter()
            .map(|d| d.to_string())
            .collect();
        let tier = plan
            .iter()
            .find(|l| l.contains("queue    ns.orders.delay.10s"))
            .unwrap();
        assert_eq!(
            tier,
            "queue    ns.orders.delay.10s durable x-queue-type=quorum x-message-ttl=10000 \
             x-dead-letter-exchange=ns.orders.due x-dead-letter-strategy=at-least-once x-overflow=reject-publish"
        );
        assert!(plan.contains(&"binding  ns.orders.tiers -> ns.orders.delay.1h key=\"1h\"".to_string()));
        assert!(plan.contains(&"queue    ns.orders.parked durable x-queue-type=stream".to_string()));
        assert!(plan.contains(&"binding  ns.orders -> ns.orders.intake key=\"\"".to_string()));
        assert!(plan.contains(&"binding  ns.orders.due -> ns.orders.due key=\"\"".to_string()));
    }

    #[test]
    fn classic_long_tiers_are_lazy_and_short_ones_are_not() {
        let s = spec(QueueType::Classic, DeadLetterStrategy::AtMostOnce);
        let plan = plan_ladder(&Names::new("ns", "orders"), &s);
        let args_of = |name: &str| {
            plan.iter()
                .find_map(|d| match d {
                    Declaration::Queue { name: n, args } if n == name => Some(args.clone()),
                    _ => None,
                })
                .unwrap()
        };
        assert!(args_of("ns.orders.delay.1h").contains(&("x-queue-mode", ArgValue::Str("lazy".into()))));
        assert!(!args_of("ns.orders.delay.10s").iter().any(|(k, _)| *k == "x-queue-mode"));
        assert!(
            !args_of("ns.orders.delay.10s")
                .iter()
                .any(|(k, _)| *k == "x-dead-letter-strategy")
        );
    }
}
