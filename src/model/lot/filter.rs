//! Which parked entries an operator means: the [`Filter`] every tool builds from its input,
//! and the parsing of that input (time bounds, header pairs).

use std::collections::BTreeSet;
use std::time::UNIX_EPOCH;

use serde_json::Value;

use crate::model::envelope::{self, Envelope};
use crate::model::lot::Invalid;

/// Which entries to act on. Every field narrows; the default matches everything.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Filter {
    /// Only these offsets.
    pub offsets: Option<BTreeSet<u64>>,
    /// The ladder that parked it.
    pub ladder: Option<String>,
    /// The queue it was headed for.
    pub destination: Option<String>,
    /// The reason code.
    pub reason: Option<String>,
    /// Parked at or after, ms since the epoch.
    pub since_ms: Option<u64>,
    /// Parked at or before, ms since the epoch.
    pub until_ms: Option<u64>,
    /// The original `message_id`.
    pub message_id: Option<String>,
    /// The original `correlation_id`.
    pub correlation_id: Option<String>,
    /// Original headers that must have these values (text, or an integer's decimal form).
    pub headers: Vec<(String, String)>,
    /// A substring of the original body; bodies that are not UTF-8 never match.
    pub body_contains: Option<String>,
    /// Unresolved entries only (the default), or resolved ones too. A replay or a discard acts
    /// on unresolved entries only, whatever this says.
    pub entries: Entries,
}

/// Which entries a [`Filter`] looks at, by their resolution.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Entries {
    /// Entries nobody replayed or discarded yet.
    #[default]
    Unresolved,
    /// Every entry, resolved or not.
    All,
}

impl Filter {
    /// Whether no field narrows (every unresolved entry matches): which entries it looks at is
    /// no narrowing.
    pub fn is_empty(&self) -> bool {
        *self == Filter::default().with_entries(self.entries)
    }

    /// This filter, looking at `entries`.
    pub fn with_entries(self, entries: Entries) -> Self {
        Filter { entries, ..self }
    }

    /// Whether a field narrows that the [`LotIndex`](super::index::LotIndex) does not hold exactly (headers, body,
    /// ladder; message and correlation ids, which it keeps as 64-bit hashes), so the candidates'
    /// records must be read and checked with [`Filter::matches`]. The index may over-select,
    /// never mis-select: whatever it over-selects is dropped here.
    pub fn needs_records(&self) -> bool {
        self.ladder.is_some()
            || !self.headers.is_empty()
            || self.body_contains.is_some()
            || self.message_id.is_some()
            || self.correlation_id.is_some()
    }

    /// Whether the entry at `offset` matches. Cheap checks first; the body is decoded last.
    pub fn matches(&self, offset: u64, e: &Envelope) -> bool {
        let eq = |want: &Option<String>, have: Option<&str>| want.as_deref().is_none_or(|w| have == Some(w));
        let props = &e.message.properties;
        let text = |name: &str| props.get(name).and_then(envelope::short_text);
        let prop = |name: &str| text(name);
        self.offsets.as_ref().is_none_or(|o| o.contains(&offset))
            && eq(&self.ladder, Some(&e.ladder))
            && eq(&self.destination, e.destination.as_deref())
            && eq(&self.reason, Some(&e.reason))
            && self.since_ms.is_none_or(|t| e.parked_at_ms >= t)
            && self.until_ms.is_none_or(|t| e.parked_at_ms <= t)
            && eq(&self.message_id, prop("message_id").as_deref())
            && eq(&self.correlation_id, prop("correlation_id").as_deref())
            && self.headers.iter().all(|(k, v)| {
                header_text(props.get("headers").and_then(|h| envelope::table_get(h, k))).as_deref() == Some(v.as_str())
            })
            && self.body_contains.as_ref().is_none_or(|needle| {
                e.message
                    .body()
                    .ok()
                    .and_then(|b| String::from_utf8(b).ok())
                    .is_some_and(|text| text.contains(needle.as_str()))
            })
    }
}

/// A typed header value (`{"type", "value"}`) as text: strings as they are, integers in
/// decimal, booleans as `true`/`false`; other types have no text form.
pub(crate) fn header_text(typed: Option<&Value>) -> Option<String> {
    let value = typed?.get("value")?;
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Parses a `--since`/`--until` bound: RFC 3339 (`2026-11-22T01:00:00Z`) or a humantime
/// duration before `now_ms` (`15m`, `2h 30m`). Returns ms since the epoch.
pub fn parse_time_bound(text: &str, now_ms: u64) -> Result<u64, Invalid> {
    let text = text.trim();
    if let Ok(time) = humantime::parse_rfc3339_weak(text) {
        return time
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .map_err(|_| Invalid(format!("{text:?} is before 1970")));
    }
    match humantime::parse_duration(text) {
        Ok(ago) => Ok(now_ms.saturating_sub(ago.as_millis() as u64)),
        Err(_) => Err(Invalid(format!(
            "{text:?} is neither an RFC 3339 time nor a duration ago such as \"15m\""
        ))),
    }
}

/// Parses a `--header key=value` filter.
pub fn parse_header_filter(text: &str) -> Result<(String, String), Invalid> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(Invalid(format!("{text:?} is not key=value"))),
    }
}

/// A filter as an operator gives it, from any front end — CLI flags, a query string, a JSON
/// body, a web form — before it is checked: texts, with empty ones meaning "not given". The one
/// way from user input to a [`Filter`] ([`FilterInput::build`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FilterInput {
    /// Stream offsets.
    pub offsets: Vec<u64>,
    /// The queue it was headed for.
    pub destination: Option<String>,
    /// The reason code.
    pub reason: Option<String>,
    /// The original message id.
    pub message_id: Option<String>,
    /// The original correlation id.
    pub correlation_id: Option<String>,
    /// Original headers, each `(key, value)` (see [`parse_header_filter`] for `key=value`).
    pub headers: Vec<(String, String)>,
    /// A substring of the body.
    pub body_contains: Option<String>,
    /// Parked at or after: RFC 3339 or a duration ago.
    pub since: Option<String>,
    /// Parked at or before: RFC 3339 or a duration ago.
    pub until: Option<String>,
}

impl FilterInput {
    /// Sets the field a query-string or form key names (`body` is the short form of
    /// `body_contains`; `header` is `key=value` and adds one). Returns `Ok(false)` for a key
    /// that names no filter field, so the caller can handle its own (`limit`, `token` …).
    pub fn set(&mut self, key: &str, value: &str) -> Result<bool, Invalid> {
        let text = Some(value.to_string());
        match key {
            "destination" => self.destination = text,
            "reason" => self.reason = text,
            "message_id" => self.message_id = text,
            "correlation_id" => self.correlation_id = text,
            "header" => self.headers.push(parse_header_filter(value)?),
            "body" | "body_contains" => self.body_contains = text,
            "since" => self.since = text,
            "until" => self.until = text,
            "offsets" => {
                for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                    self.offsets.push(
                        part.parse()
                            .map_err(|_| Invalid(format!("{part:?} is not an offset")))?,
                    );
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The checked filter: texts trimmed, empty ones dropped, times resolved against `now_ms`.
    pub fn build(self, now_ms: u64) -> Result<Filter, Invalid> {
        let text = |t: Option<String>| t.map(|t| t.trim().to_string()).filter(|t| !t.is_empty());
        let time = |t: Option<String>| text(t).map(|t| parse_time_bound(&t, now_ms)).transpose();
        Ok(Filter {
            offsets: (!self.offsets.is_empty()).then(|| self.offsets.into_iter().collect()),
            ladder: None,
            destination: text(self.destination),
            reason: text(self.reason),
            since_ms: time(self.since)?,
            until_ms: time(self.until)?,
            message_id: text(self.message_id),
            correlation_id: text(self.correlation_id),
            headers: self.headers,
            // a body search matches what it is given, spaces and all
            body_contains: self.body_contains.filter(|b| !b.is_empty()),
            entries: Entries::Unresolved,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::envelope::testing::{header_table, parked_envelope};
    use crate::model::protocol::long_string;
    use ladder_amqp::{BasicProperties, FieldTable, FieldValue};

    #[test]
    fn empty_filter_matches_everything() {
        let e = parked_envelope("no-route", None, 5, BasicProperties::default(), b"");
        assert!(Filter::default().is_empty());
        assert!(Filter::default().matches(0, &e));
    }

    #[test]
    fn filters_by_each_field() {
        let props = BasicProperties::default()
            .with_message_id("m-1")
            .with_correlation_id("c-1")
            .with_headers(header_table(&[
                ("tenant", long_string("acme")),
                ("n", FieldValue::LongInt(7)),
                ("t", FieldValue::FieldTable(FieldTable::default())),
            ]));
        let e = parked_envelope("max-attempts", Some("orders"), 1_000, props, b"{\"order\": 42}");
        let yes = |f: Filter| assert!(f.matches(10, &e), "{f:?} should match");
        let no = |f: Filter| assert!(!f.matches(10, &e), "{f:?} should not match");
        let f = Filter::default;
        yes(Filter {
            offsets: Some(BTreeSet::from([10])),
            ..f()
        });
        no(Filter {
            offsets: Some(BTreeSet::from([11])),
            ..f()
        });
        yes(Filter {
            ladder: Some("default".into()),
            ..f()
        });
        no(Filter {
            ladder: Some("other".into()),
            ..f()
        });
        yes(Filter {
            destination: Some("orders".into()),
            ..f()
        });
        no(Filter {
            destination: Some("orders2".into()),
            ..f()
        });
        yes(Filter {
            reason: Some("max-attempts".into()),
            ..f()
        });
        no(Filter {
            reason: Some("no-route".into()),
            ..f()
        });
        yes(Filter {
            since_ms: Some(1_000),
            until_ms: Some(1_000),
            ..f()
        });
        no(Filter {
            since_ms: Some(1_001),
            ..f()
        });
        no(Filter {
            until_ms: Some(999),
            ..f()
        });
        yes(Filter {
            message_id: Some("m-1".into()),
            ..f()
        });
        no(Filter {
            message_id: Some("m-2".into()),
            ..f()
        });
        yes(Filter {
            correlation_id: Some("c-1".into()),
            ..f()
        });
        no(Filter {
            correlation_id: Some("m-1".into()),
            ..f()
        });
        yes(Filter {
            headers: vec![("tenant".into(), "acme".into()), ("n".into(), "7".into())],
            ..f()
        });
        no(Filter {
            headers: vec![("tenant".into(), "acme".into()), ("n".into(), "8".into())],
            ..f()
        });
        no(Filter {
            headers: vec![("missing".into(), "".into())],
            ..f()
        });
        no(Filter {
            headers: vec![("t".into(), "{}".into())],
            ..f()
        });
        yes(Filter {
            body_contains: Some("\"order\": 4".into()),
            ..f()
        });
        no(Filter {
            body_contains: Some("invoice".into()),
            ..f()
        });
    }

    #[test]
    fn body_filter_skips_binary_bodies_and_unknown_destinations() {
        let e = parked_envelope(
            "no-destination",
            None,
            1,
            BasicProperties::default(),
            &[0xff, 0xfe, b'a'],
        );
        let f = Filter {
            body_contains: Some("a".into()),
            ..Filter::default()
        };
        assert!(!f.matches(0, &e));
        let f = Filter {
            destination: Some("orders".into()),
            ..Filter::default()
        };
        assert!(!f.matches(0, &e));
    }

    #[test]
    fn time_bounds_parse() {
        let now = 10_000_000;
        assert_eq!(parse_time_bound("15m", now).unwrap(), now - 15 * 60 * 1000);
        assert_eq!(parse_time_bound("1h 30m", now).unwrap(), now - 90 * 60 * 1000);
        assert_eq!(parse_time_bound("1970-01-01T00:00:10Z", now).unwrap(), 10_000);
        assert!(parse_time_bound("yesterday", now).is_err());
        assert_eq!(parse_time_bound("1000h", 5).unwrap(), 0);
    }

    #[test]
    fn header_filters_parse() {
        assert_eq!(
            parse_header_filter("tenant=a=b").unwrap(),
            ("tenant".to_string(), "a=b".to_string())
        );
        assert_eq!(parse_header_filter("k=").unwrap(), ("k".to_string(), String::new()));
        assert!(parse_header_filter("=v").is_err());
        assert!(parse_header_filter("kv").is_err());
    }

    #[test]
    fn every_front_end_builds_the_same_filter_from_the_same_input() {
        let now = 10 * 3_600_000;
        let mut typed = FilterInput::default();
        for (k, v) in [
            ("destination", " orders "),
            ("reason", "max-attempts"),
            ("header", "tenant=t1"),
            ("body", "needle"),
            ("since", "2h"),
            ("until", ""),
            ("message_id", ""),
        ] {
            assert!(typed.set(k, v).unwrap(), "{k}");
        }
        assert!(!typed.set("limit", "5").unwrap(), "not a filter field");
        let built = typed.clone().build(now).unwrap();
        assert_eq!(built.destination.as_deref(), Some("orders"));
        assert_eq!(built.headers, [("tenant".to_string(), "t1".to_string())]);
        assert_eq!(built.body_contains.as_deref(), Some("needle"));
        assert_eq!(built.since_ms, Some(8 * 3_600_000));
        assert_eq!(
            (built.until_ms, built.message_id.as_deref()),
            (None, None),
            "empty means not given"
        );
        let same = FilterInput {
            destination: Some("orders".into()),
            reason: Some("max-attempts".into()),
            headers: vec![("tenant".into(), "t1".into())],
            body_contains: Some("needle".into()),
            since: Some("2h".into()),
            ..FilterInput::default()
        };
        assert_eq!(same.build(now).unwrap(), built);
        assert!(FilterInput::default().build(now).unwrap().is_empty());
        let blank = FilterInput {
            destination: Some("  ".into()),
            ..FilterInput::default()
        };
        assert!(blank.build(now).unwrap().is_empty(), "blank is not a filter");
        let mut bad = FilterInput::default();
        assert!(bad.set("header", "no-equals-sign").is_err());
        assert!(bad.set("offsets", "1,x").is_err());
        let late = FilterInput {
            since: Some("yesterday-ish".into()),
            ..FilterInput::default()
        };
        assert!(late.build(now).is_err());
    }

    #[test]
    fn ids_the_index_keeps_as_hashes_are_checked_on_the_records() {
        let by = |f: fn(&mut Filter)| {
            let mut filter = Filter::default();
            f(&mut filter);
            filter.needs_records()
        };
        assert!(by(|f| f.message_id = Some("m".into())), "two ids may share a hash");
        assert!(by(|f| f.correlation_id = Some("c".into())));
        assert!(!by(|f| f.reason = Some("no-route".into())), "held exactly by the index");
        assert!(!by(|f| f.destination = Some("orders".into())));
        // the record check tells two ids with the same hash apart
        let props = BasicProperties::default().with_message_id("m-1");
        let e = parked_envelope("no-route", None, 5, props, b"");
        let other = Filter {
            message_id: Some("m-2".into()),
            ..Filter::default()
        };
        assert!(!other.matches(0, &e));
    }
}
