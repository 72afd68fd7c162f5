//! Ladder: delayed retries with stepped backoff, a parking lot and exact redelivery for every
//! service on a RabbitMQ broker.
//!
//! One house with three wings over a pure core, imports running downwards only:
//!
//! - [`model`] — what a ladder is and decides: names, the header protocol, the parked-record
//!   formats, filters and the index, the accounting identity, the backoff. Pure: no I/O, no
//!   clock, no other wing (a test enforces it).
//! - [`broker`] — every AMQP conversation: the supervisor, topology, the relay loops, the
//!   parking lot's stream.
//! - [`admin`] — the operator side, off the worker path: the HTTP server, the API, the web page,
//!   the desk and its jobs, the depth poller.
//! - The binary's `cli` (in `src/cli/`) — the `ladder` commands.
//!
//! Beside them: [`config`], [`metrics`], [`telemetry`] (which use the model only) and
//! [`clock`]. See ARCHITECTURE.md for the code map and its invariants.

#![forbid(unsafe_code)]
#![warn(unreachable_pub, clippy::unwrap_in_result, missing_docs)]

/// Stack size for every thread that handles a message. Header tables are captured into the
/// parked envelope and decoded, rendered and dropped recursively, and a header may nest about
/// 18 700 levels within one frame; 2 MiB overflowed at 1 000. The memory is reserved, not
/// committed, so a large value costs nothing until used.
pub const DEEP_STACK_BYTES: usize = 256 * 1024 * 1024;

pub mod admin;
pub mod broker;
pub mod clock;
pub mod config;
pub mod metrics;
pub mod model;
pub mod telemetry;
