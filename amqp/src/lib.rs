//! The AMQP 0-9-1 client Ladder talks to RabbitMQ with.
//!
//! Why not an existing client: Ladder must never lose or wedge a message, and the Rust clients
//! it tried break that for inputs RabbitMQ accepts. This one differs where it matters:
//!
//! - **Strings are bytes.** A `message_id`, header name, table key or routing key that is not
//!   UTF-8 decodes like any other ([`types`]); properties that do not decode at all (nesting
//!   beyond [`types::MAX_DEPTH`]) arrive as bytes with the delivery ([`Undecodable`]) and can be
//!   published again unchanged ([`Channel::basic_publish_raw`]). No message can fail a frame, so
//!   none can take a connection — and every other delivery on it — down.
//! - **A return is matched to its own publish**, whatever order the acks of a `multiple` confirm
//!   are processed in ([`channel`] explains how).
//! - **Publishing and acking do not wait.** Frames go into one buffer that a writer task drains,
//!   so many publishes are in flight at once and a burst leaves in one write.
//!
//! It is small on purpose: connection (PLAIN or EXTERNAL login, TLS, heartbeats), channels,
//! exchange and queue declarations, consumers, publishing with confirms, acks. No automatic
//! recovery: when a connection fails, every channel, consumer and pending confirm fails with it,
//! and the caller reconnects (unacked deliveries return to their queues).

#![forbid(unsafe_code)]
#![warn(unreachable_pub, missing_docs, clippy::unwrap_in_result)]

pub mod channel;
pub mod connection;
pub mod error;
pub mod frame;
mod io;
pub mod method;
pub mod properties;
pub mod tls;
pub mod types;
pub mod uri;

pub use channel::{
    Channel, Confirmation, Consumer, Delivery, PublishConfirm, QueueInfo, QueueOptions, Returned, Undecodable,
};
pub use connection::{ConnectOptions, Connection};
pub use error::{CloseReason, Error, Result};
pub use properties::BasicProperties;
pub use tls::TlsOptions;
pub use types::{
    Carried, DEAD_LETTER_HEADERS, Decimal, FieldTable, FieldValue, LongString, ShortString, share_table_keys,
};
pub use uri::AmqpUri;
