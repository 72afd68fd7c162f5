//! The integration tests that leave the brokers running, in one binary (one link of the crate
//! instead of one per file). The tests that restart or kill a broker are binaries of their own
//! (`tests/disruptive.rs`, `tests/faults.rs`) and run apart, after these.
//!
//! Run one file's tests with its module path: `cargo test --test it parking_http::`.

#[path = "../common/mod.rs"]
mod common;

mod admin;
mod bad_input;
mod browser;
mod cli;
mod cli_api;
mod console;
mod crash;
mod deploy;
mod docs;
mod examples;
mod holds;
mod nothing_lost;
mod one_hop;
mod openapi;
mod operator_views;
mod parking;
mod parking_http;
mod regressions;
mod retry;
mod retune;
mod routed_refusals;
mod scheduled;
mod security;
mod shared;
mod source_size;
mod traces;
