//! The parking lot as data: the records of a parked stream, the filters operators select
//! them with, the index that answers counts and pages, paced replays, and the text operators
//! read. The broker wing (`broker::lot`) reads and writes the stream.

pub mod edit;
pub mod filter;
pub mod index;
pub mod pace;
pub mod record;
pub mod text;

/// Input that does not make sense — a filter, a rate, a record — said in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);
