//! Ladder: delayed retries with stepped backoff, a parking lot and exact redelivery for every
//! service on a RabbitMQ broker.
//!
//! The binary (`src/main.rs`) parses the command line and calls into this library; the
//! integration tests call the same entry points. See ARCHITECTURE.md for the code map.

#![forbid(unsafe_code)]
#![warn(unreachable_pub, clippy::unwrap_in_result, missing_docs)]

/// Stack size for every thread that handles a message: header tables are parsed (by lapin),
/// captured into the parked envelope and decoded recursively, and a header may legally nest
/// about 18 700 levels within one 128 KiB frame. At 2 MiB, lapin's I/O thread overflowed at
/// 1 000 levels in a release build, which aborted the process; the memory is reserved, not
/// committed, so a large value costs nothing until used.
pub const DEEP_STACK_BYTES: usize = 256 * 1024 * 1024;

pub mod accounting;
pub mod admin;
pub mod api;
pub mod config;
pub mod envelope;
pub mod ladder;
pub mod lot_index;
pub mod metrics;
pub mod operator;
pub mod parking;
pub mod poller;
pub mod protocol;
pub mod relay;
pub mod service;
pub mod telemetry;
pub mod topology;
pub mod web;
