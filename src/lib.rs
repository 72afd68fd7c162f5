//! Ladder: delayed retries with stepped backoff, a parking lot and exact redelivery for every
//! service on a RabbitMQ broker.
//!
//! The binary (`src/main.rs`) parses the command line and calls into this library; the
//! integration tests call the same entry points. See ARCHITECTURE.md for the code map.

#![forbid(unsafe_code)]
#![warn(unreachable_pub, clippy::unwrap_in_result, missing_docs)]

pub mod config;
pub mod envelope;
pub mod ladder;
pub mod protocol;
pub mod relay;
pub mod service;
pub mod topology;
