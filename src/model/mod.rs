//! The pure core: what a ladder is, the header protocol and its decisions, the parked-record
//! formats, the parking-lot index and filters, the accounting identity, the backoff.
//!
//! Nothing here does I/O, reads a clock or knows the broker client's connections and channels:
//! callers hand in the time and the message's properties, and get decisions and values back.
//! Everything here is unit-tested (and fuzzed) without a broker;
//! `tests::the_model_does_no_io_and_knows_no_other_wing` fails if a file here names the
//! client's connections or channels, tokio, a clock read, or another wing.

pub mod accounting;
pub mod backoff;
pub mod cancels;
pub mod drift;
pub mod envelope;
pub mod holds;
pub mod ladder;
pub mod leaving;
pub mod lot;
pub mod names;
pub mod plan;
pub mod progress;
pub mod protocol;
pub mod upgrade;

/// The schema of a string that is one of `words`, for a field the API answers as text but the
/// code keeps as one of a closed set (the OpenAPI description names the set).
pub fn words_schema(words: impl IntoIterator<Item = &'static str>) -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(words))
        .build()
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    /// What the model must not use: the client's connections and channels, an async runtime, a
    /// clock, the file system or the network, and the other wings (they use the model).
    const FORBIDDEN: [&str; 15] = [
        "tokio",
        "ladder_amqp::Connection",
        "ladder_amqp::Channel",
        "ladder_amqp::{Channel",
        "ladder_amqp::{Connection",
        "crate::broker",
        "crate::admin",
        "crate::config",
        "crate::clock",
        "crate::metrics",
        "crate::telemetry",
        "SystemTime::now",
        "Instant::now",
        "std::fs",
        "std::net",
    ];

    fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    #[test]
    fn the_model_does_no_io_and_knows_no_other_wing() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/model");
        let mut files = Vec::new();
        sources(&dir, &mut files);
        assert!(files.len() > 10, "found only {files:?}");
        let mut found = Vec::new();
        for file in files.iter().filter(|f| !f.ends_with("testing.rs")) {
            let text = std::fs::read_to_string(file).unwrap();
            // the code, not its tests or its comments
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            for (n, line) in code.lines().enumerate() {
                if line.trim_start().starts_with("//") {
                    continue;
                }
                for bad in FORBIDDEN {
                    if line.contains(bad) {
                        found.push(format!("{}:{}: {bad}", file.display(), n + 1));
                    }
                }
            }
        }
        assert!(found.is_empty(), "the model must stay pure:\n{}", found.join("\n"));
    }
}
