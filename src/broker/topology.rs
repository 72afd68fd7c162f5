//! Declares a ladder's topology on the broker ([`crate::model::plan`] says what), keeping
//! queues an older version declared in another shape.

use ladder_amqp::{Channel, Connection, FieldTable, FieldValue, QueueOptions};

use crate::config::Config;
pub use crate::model::names::Names;
pub use crate::model::plan::{ArgValue, BrokerVersion, DELIVERY_LIMIT, Declaration};

/// Everything the service declares for `config` on a broker of `version`.
pub fn plan(config: &Config, version: BrokerVersion) -> Vec<Declaration> {
    crate::model::plan::plan(&config.namespace, &config.ladders, version)
}

/// What the service declares for `config` on a broker of `version` where the topology stream
/// knows `registry`: each ladder an earlier release declared with its forwarding layer
/// ([`crate::model::upgrade`]), without the unbinds.
pub fn plan_known(
    config: &Config,
    version: BrokerVersion,
    registry: &crate::model::drift::Registry,
) -> Vec<Declaration> {
    use crate::model::upgrade::{self, Before};
    let mut out = crate::model::plan::plan_shared(&config.namespace, &config.ladders, version);
    for spec in &config.ladders {
        let names = Names::of(&config.namespace, spec);
        let before = Before::from_older(upgrade::forwards(registry, &names));
        out.extend(upgrade::plan_ladder(&names, spec, version, before));
    }
    out.retain(|d| !matches!(d, Declaration::Unbinding { .. }));
    out
}

/// The version of the broker `connection` is open to (the latest if it does not say).
pub fn version_of(connection: &Connection) -> BrokerVersion {
    BrokerVersion::from_server(connection.server_version())
}

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
        source: ladder_amqp::Error,
    },
}

/// A queue kept in the shape an older version declared it in (see [`Declaration::Queue`]).
#[derive(Debug, Clone, PartialEq)]
pub struct OlderQueue {
    /// The queue.
    pub name: String,
    /// The arguments it lacks, with their values.
    pub missing: Vec<(&'static str, ArgValue)>,
}

impl OlderQueue {
    /// The `rabbitmqctl set_policy` command that gives the queue what it lacks (a policy's
    /// keys are the arguments' without `x-`).
    pub fn policy_command(&self) -> String {
        let definition: Vec<String> = self
            .missing
            .iter()
            .map(|(key, value)| {
                let key = key.trim_start_matches("x-");
                match value {
                    ArgValue::Str(s) => format!("\"{key}\": \"{s}\""),
                    ArgValue::Int(i) => format!("\"{key}\": {i}"),
                    ArgValue::Bool(b) => format!("\"{key}\": {b}"),
                    ArgValue::Void => format!("\"{key}\": null"),
                }
            })
            .collect();
        let pattern = format!("^{}$", regex::escape(&self.name));
        format!(
            "rabbitmqctl set_policy {} '{pattern}' '{{{}}}' --apply-to queues",
            self.name,
            definition.join(", ")
        )
    }
}

/// Declares `declarations` in order, on channels of `connection`. A queue that exists in an
/// older shape ([`Declaration::Queue::older`]) is kept and returned, to be reported; any other
/// precondition failure is a [`TopologyError::Conflict`]. `each` hears of each declaration as it
/// is made (a starting session names it on `/ready`).
pub async fn apply(
    connection: &Connection,
    declarations: &[Declaration],
    each: &(dyn Fn(&Declaration) + Sync),
) -> Result<Vec<OlderQueue>, TopologyError> {
    let broker = |declaration: &Declaration, source| TopologyError::Broker {
        declaration: declaration.to_string(),
        source,
    };
    let mut channel = connection
        .create_channel()
        .await
        .map_err(|e| broker(&declarations[0], e))?;
    let mut older_queues = Vec::new();
    for declaration in declarations {
        each(declaration);
        let Err(source) = declare(&channel, declaration, None).await else {
            continue;
        };
        if matches!(declaration, Declaration::Unbinding { .. }) && not_found(&source) {
            // the binding's queue is gone, or never was (a tier declared by an older Ladder):
            // nothing to remove; the 404 closed the channel
            channel = connection.create_channel().await.map_err(|e| broker(declaration, e))?;
            continue;
        }
        let Some(detail) = precondition_detail(&source) else {
            return Err(broker(declaration, source));
        };
        // the 406 closed the channel
        channel = connection.create_channel().await.map_err(|e| broker(declaration, e))?;
        if let Declaration::Queue {
            name,
            args,
            older: Some(older),
        } = declaration
        {
            match declare(&channel, declaration, Some(older)).await {
                Ok(()) => {
                    older_queues.push(OlderQueue {
                        name: name.clone(),
                        missing: args.iter().filter(|a| !older.contains(a)).cloned().collect(),
                    });
                    continue;
                }
                Err(e) if precondition_detail(&e).is_some() => {}
                Err(e) => return Err(broker(declaration, e)),
            }
        }
        return Err(TopologyError::Conflict {
            declaration: declaration.to_string(),
            detail,
        });
    }
    let _ = channel.close(200, "declared").await;
    Ok(older_queues)
}

/// Declares one thing; a queue with `args_instead` rather than its own arguments.
async fn declare(
    channel: &Channel,
    declaration: &Declaration,
    args_instead: Option<&[(&'static str, ArgValue)]>,
) -> ladder_amqp::Result<()> {
    match declaration {
        Declaration::Exchange { name, kind, args } => channel.exchange_declare(name, kind, true, table(args)).await,
        Declaration::Queue { name, args, .. } => {
            let options = QueueOptions {
                durable: true,
                ..Default::default()
            };
            channel
                .queue_declare(name, options, table(args_instead.unwrap_or(args)))
                .await
                .map(|_| ())
        }
        Declaration::Binding {
            exchange,
            queue,
            key,
            args,
            to_exchange: false,
        } => channel.queue_bind(queue, exchange, key, table(args)).await,
        Declaration::Binding {
            exchange,
            queue,
            key,
            args,
            to_exchange: true,
        } => channel.exchange_bind(queue, exchange, key, table(args)).await,
        Declaration::Unbinding {
            exchange,
            queue,
            key,
            args,
            to_exchange: false,
        } => channel.queue_unbind(queue, exchange, key, table(args)).await,
        Declaration::Unbinding {
            exchange,
            queue,
            key,
            args,
            to_exchange: true,
        } => channel.exchange_unbind(queue, exchange, key, table(args)).await,
    }
}

/// Arguments as an AMQP table.
pub(crate) fn table(args: &[(&'static str, ArgValue)]) -> FieldTable {
    let mut table = FieldTable::new();
    for (key, value) in args {
        let value = match value {
            ArgValue::Str(s) => FieldValue::string(s),
            ArgValue::Int(i) => FieldValue::LongLongInt(*i),
            ArgValue::Bool(b) => FieldValue::Boolean(*b),
            ArgValue::Void => FieldValue::Void,
        };
        table.set(key, value);
    }
    table
}

/// Whether `error` is the broker's 404 NOT_FOUND channel close.
pub(crate) fn not_found(error: &ladder_amqp::Error) -> bool {
    matches!(error, ladder_amqp::Error::ChannelClosed(reason) if reason.code == 404)
}

/// The broker's text if `error` is a 406 PRECONDITION_FAILED channel close.
pub(crate) fn precondition_detail(error: &ladder_amqp::Error) -> Option<String> {
    match error {
        ladder_amqp::Error::ChannelClosed(reason) if reason.code == 406 => Some(reason.text.clone()),
        _ => None,
    }
}
