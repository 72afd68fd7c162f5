//! Operator-facing text: tables and entries for the terminal, and the value formatting the
//! web page shares. Every string a message controls is made inert here (control characters
//! shown visibly); every time or number renders, whatever its value.

use std::fmt::Write as _;
use std::time::{Duration, UNIX_EPOCH};

use serde::Serialize;
use serde_json::Value;

use crate::model::envelope::{self, Envelope};
use crate::model::lot::index::Counts;
use crate::model::lot::record::Action;
use crate::model::lot::record::{ParkedEntry, Resolution};

/// `ms` since the epoch as RFC 3339, to the second (UTC). A time RFC 3339 cannot show (after
/// the year 9999: a record may carry any `u64`) is the number itself, with a note.
pub fn format_time(ms: u64) -> String {
    let mut out = String::new();
    // humantime's `Display` fails (and `to_string` would panic) after 9999-12-31T23:59:59Z
    match UNIX_EPOCH.checked_add(Duration::from_millis(ms)) {
        Some(time) if write!(out, "{}", humantime::format_rfc3339_seconds(time)).is_ok() => out,
        _ => format!("{ms} ms since the epoch (after the year 9999)"),
    }
}

/// Whether `c` is a control character (C0, DEL or C1: `\u{9b}` is a one-byte CSI to some
/// terminals), a bidirectional control (embeddings, overrides, isolates and marks, which
/// reorder or hide what follows them) or another invisible format character a terminal may act
/// on or a reader cannot see (zero-width characters, the soft hyphen, the line and paragraph
/// separators, the byte order mark, interlinear annotations, tag characters).
fn hidden(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{ad}'
                | '\u{61c}'
                | '\u{180e}'
                | '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{206f}'
                | '\u{feff}'
                | '\u{fff9}'..='\u{fffb}'
                | '\u{e0000}'..='\u{e007f}'
        )
}

/// `text` with every control character (and every bidirectional override, which reorders what
/// follows it) escaped as Rust writes it (`\n`, `\u{1b}`), so that a value from a message can
/// neither garble a terminal nor hide text on a page. Anything else is left as it is.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(hidden) {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if hidden(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    out.into()
}

/// A stored property value as [`printable`] text: JSON, except that a short string kept as
/// bytes (`{"base64": …}`) shows as its lossy text with the exact bytes' base64.
fn property_text(value: &Value) -> String {
    let text = match (value.get("base64").and_then(Value::as_str), envelope::short_text(value)) {
        (Some(b64), Some(text)) => format!("{} (bytes, base64 {})", Value::String(text), Value::from(b64)),
        _ => value.to_string(),
    };
    printable(&text).into_owned()
}

/// A typed header value (`{"type", "value"}`, or `"base64"` for bytes) as [`printable`] text:
/// its JSON value, or `base64 "…"` for bytes.
fn typed_value_text(typed: &Value) -> String {
    let text = match (typed.get("value"), typed.get("base64")) {
        (Some(value), _) => value.to_string(),
        (None, Some(b64)) => format!("base64 {b64}"),
        (None, None) => Value::Null.to_string(),
    };
    printable(&text).into_owned()
}

/// The message id an entry shows: lossy text for bytes, `-` when there is none.
fn shown_message_id(e: &Envelope) -> String {
    e.message
        .properties
        .get("message_id")
        .and_then(envelope::short_text)
        .map_or_else(|| "-".into(), |id| printable(&id).into_owned())
}

/// A human table of `entries`: offset, parked at, ladder, reason, destination, attempts,
/// message id, and the resolution when any entry has one.
pub fn render_table(entries: &[ParkedEntry]) -> String {
    let with_resolution = entries.iter().any(|e| e.resolution.is_some());
    let mut rows = vec![vec![
        "OFFSET".to_string(),
        "PARKED AT".into(),
        "LADDER".into(),
        "REASON".into(),
        "DESTINATION".into(),
        "ATTEMPTS".into(),
        "MESSAGE ID".into(),
    ]];
    if with_resolution {
        rows[0].push("RESOLUTION".into());
    }
    for entry in entries {
        let e = &entry.envelope;
        let mut row = vec![
            entry.offset.to_string(),
            format_time(e.parked_at_ms),
            printable(&e.ladder).into_owned(),
            printable(&e.reason).into_owned(),
            e.destination
                .as_deref()
                .map_or_else(|| "-".into(), |d| printable(d).into_owned()),
            e.attempts.map_or_else(|| "-".into(), |a| a.to_string()),
            shown_message_id(e),
        ];
        if with_resolution {
            row.push(
                entry
                    .resolution
                    .as_ref()
                    .map_or_else(|| "-".into(), describe_resolution),
            );
        }
        rows.push(row);
    }
    let columns = rows[0].len();
    let widths: Vec<usize> = (0..columns)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
    out
}

fn describe_resolution(r: &Resolution) -> String {
    let action = match r.action {
        Action::Replayed => format!("replayed to {}", printable(r.to.as_deref().unwrap_or("?"))),
        Action::Discarded => "discarded".to_string(),
    };
    format!("{action} by {} at {}", printable(&r.by), format_time(r.at_ms))
}

/// One entry in full: reason and detail, attempts and times, the attempt history and lineage,
/// properties, headers (with their AMQP types) and the body — as text when it is UTF-8,
/// otherwise as hex.
pub fn render_entry(stream: &str, entry: &ParkedEntry) -> String {
    let e = &entry.envelope;
    let mut out = String::new();
    let _ = writeln!(out, "entry        {stream}@{}", entry.offset);
    let _ = writeln!(out, "ladder       {}", printable(&e.ladder));
    let _ = writeln!(out, "reason       {}", printable(&e.reason));
    let _ = writeln!(out, "detail       {}", printable(&e.detail));
    let _ = writeln!(
        out,
        "destination  {}",
        printable(e.destination.as_deref().unwrap_or("-"))
    );
    let _ = writeln!(
        out,
        "attempts     {}",
        e.attempts.map_or_else(|| "-".into(), |a| a.to_string())
    );
    if let Some(first) = e.first_failed_at_ms {
        let _ = writeln!(out, "first failed {}", format_time(first));
    }
    if let Some(from) = &e.replayed_from {
        let _ = writeln!(out, "replayed from {}", printable(from));
    }
    write_history(&mut out, &e.history);
    let _ = writeln!(
        out,
        "parked at    {} (hop {})",
        format_time(e.parked_at_ms),
        printable(&e.hop)
    );
    let _ = writeln!(
        out,
        "resolution   {}",
        entry
            .resolution
            .as_ref()
            .map_or_else(|| "unresolved".into(), describe_resolution)
    );
    let _ = writeln!(
        out,
        "received on  exchange {:?}, routing key {:?}",
        e.message.exchange, e.message.routing_key
    );
    let _ = writeln!(out, "properties");
    if let Some(props) = e.message.properties.as_object() {
        for (key, value) in props.iter().filter(|(k, _)| k.as_str() != "headers") {
            let _ = writeln!(out, "  {} = {}", printable(key), property_text(value));
        }
    }
    let _ = writeln!(out, "headers");
    if let Some(headers) = e.message.properties.get("headers") {
        for (key, typed) in envelope::table_entries(headers) {
            let kind = typed.get("type").and_then(Value::as_str).unwrap_or("?");
            let _ = writeln!(
                out,
                "  {} ({}) = {}",
                printable(&key),
                printable(kind),
                typed_value_text(typed)
            );
        }
    }
    if let Some(record) = &e.message.body_record {
        let _ = writeln!(
            out,
            "body record  {} ({} bytes, stored apart)",
            printable(&record.id),
            record.bytes
        );
    }
    write_body(&mut out, entry);
    out
}

/// The attempt history, one line per attempt, in columns.
fn write_history(out: &mut String, history: &[crate::model::protocol::HistoryEntry]) {
    if !history.is_empty() {
        let _ = writeln!(out, "history");
        let tiers: Vec<_> = history.iter().map(|h| printable(&h.tier)).collect();
        let attempt_width = history.iter().map(|h| h.attempt.to_string().len()).max().unwrap_or(0);
        let tier_width = tiers.iter().map(|t| t.chars().count()).max().unwrap_or(0);
        for (h, tier) in history.iter().zip(&tiers) {
            let _ = writeln!(
                out,
                "  attempt {:<attempt_width$}  tier {:<tier_width$}  failed at {}",
                h.attempt,
                tier,
                format_time(h.failed_at_ms)
            );
        }
    }
}

/// The body: as text when it is UTF-8, otherwise as hex; at most [`SHOWN_BODY_BYTES`].
fn write_body(out: &mut String, entry: &ParkedEntry) {
    match entry.body() {
        Ok(body) => {
            let (shown, rest) = body.split_at(body.len().min(SHOWN_BODY_BYTES));
            let more = if rest.is_empty() {
                String::new()
            } else {
                format!(", the first {} shown; `ladder parked body` writes it all", shown.len())
            };
            match body_text(shown) {
                Some(text) => {
                    let _ = writeln!(out, "body ({} bytes, text{more})\n{text}", body.len());
                }
                None => {
                    let _ = writeln!(out, "body ({} bytes, hex{more})\n{}", body.len(), hex_dump(shown));
                }
            }
        }
        Err(e) => {
            let _ = writeln!(out, "body: {e}");
        }
    }
}

/// `show` prints at most this much of a body (the rest: `ladder parked body`).
pub const SHOWN_BODY_BYTES: usize = 64 * 1024;

/// Nesting beyond this many levels is not indented further by [`pretty_json`].
pub const MAX_JSON_INDENT: usize = 32;

/// `value` as indented JSON, as `serde_json::to_string_pretty` writes it up to
/// [`MAX_JSON_INDENT`] levels; deeper levels are not indented further. Strings are escaped as
/// serde_json escapes them, and DEL, the C1 controls, the bidirectional controls and the other
/// invisible format characters also as `\uXXXX` (serde_json writes those raw), so the JSON
/// printed to a terminal is as inert as the tables; it parses to the same values. A header may
/// nest tens of thousands of levels, and indenting each by its depth would make the text quadratic in it
/// (gigabytes for 24 000 levels).
pub fn pretty_json<T: Serialize + ?Sized>(value: &T) -> Result<String, serde_json::Error> {
    let mut out = Vec::with_capacity(256);
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, CappedIndent::default());
    value.serialize(&mut serializer)?;
    // serde_json writes UTF-8 only
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// serde_json's `PrettyFormatter` (two spaces a level), with indentation capped at
/// [`MAX_JSON_INDENT`] levels.
#[derive(Default)]
struct CappedIndent {
    depth: usize,
    has_value: bool,
}

impl CappedIndent {
    fn indent<W: ?Sized + std::io::Write>(&self, writer: &mut W) -> std::io::Result<()> {
        for _ in 0..self.depth.min(MAX_JSON_INDENT) {
            writer.write_all(b"  ")?;
        }
        Ok(())
    }

    fn begin<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, open: &[u8]) -> std::io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        writer.write_all(open)
    }

    fn end<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, close: &[u8]) -> std::io::Result<()> {
        self.depth -= 1;
        if self.has_value {
            writer.write_all(b"\n")?;
            self.indent(writer)?;
        }
        writer.write_all(close)
    }

    fn item<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        writer.write_all(if first { b"\n" } else { b",\n" })?;
        self.indent(writer)
    }
}

impl serde_json::ser::Formatter for CappedIndent {
    fn write_string_fragment<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        let mut start = 0;
        for (i, c) in fragment.char_indices().filter(|(_, c)| hidden(*c)) {
            writer.write_all(&fragment.as_bytes()[start..i])?;
            // a tag character is outside the BMP: JSON spells it as a surrogate pair
            for unit in c.encode_utf16(&mut [0; 2]) {
                write!(writer, "\\u{unit:04x}")?;
            }
            start = i + c.len_utf8();
        }
        writer.write_all(&fragment.as_bytes()[start..])
    }

    fn begin_array<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        self.begin(writer, b"[")
    }

    fn end_array<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        self.end(writer, b"]")
    }

    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        self.item(writer, first)
    }

    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        self.begin(writer, b"{")
    }

    fn end_object<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        self.end(writer, b"}")
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        self.item(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        writer.write_all(b": ")
    }

    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

/// Counts as two tables, per reason and per destination, largest first (both as the records
/// say them, so [`printable`]).
pub fn render_counts(counts: &Counts) -> String {
    let mut out = String::new();
    for (title, rows) in [("REASON", &counts.by_reason), ("DESTINATION", &counts.by_destination)] {
        let rows: Vec<_> = rows.iter().map(|(name, n)| (printable(name), n)).collect();
        let width = rows
            .iter()
            .map(|(name, _)| name.chars().count())
            .max()
            .unwrap_or(0)
            .max(title.len());
        let _ = writeln!(out, "{title:<width$}  {:>9}", "COUNT");
        for (name, n) in rows {
            let _ = writeln!(out, "{name:<width$}  {n:>9}");
        }
        out.push('\n');
    }
    out
}

/// A body as text, if it is text: UTF-8 without control characters other than tab, newline and
/// carriage return (a NUL or an escape sequence would garble a terminal or hide in a page).
pub fn body_text(bytes: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(bytes).ok()?;
    let printable = text.chars().all(|c| !c.is_control() || matches!(c, '\t' | '\n' | '\r'));
    printable.then_some(text)
}

/// `bytes` as hex, 16 a line, each line led by its offset.
pub fn hex_dump(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 3);
    for (i, chunk) in bytes.chunks(16).enumerate() {
        let _ = write!(out, "{:08x} ", i * 16);
        for b in chunk {
            let _ = write!(out, " {b:02x}");
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::envelope::testing::{DEEP_LEVELS, LONG, OUT_OF_RANGE_TIMES, deep_record, entry_at, odd_entry};
    use crate::model::envelope::testing::{header_table, parked_envelope};
    use crate::model::lot::record::{Action, ParkedEntry, RESOLUTION_FORMAT, Resolution};
    use crate::model::protocol::HistoryEntry;
    use ladder_amqp::{BasicProperties, FieldValue};

    #[test]
    fn table_shows_resolution_only_when_there_is_one() {
        let props = BasicProperties::default().with_message_id("m-1");
        let mut entry = ParkedEntry {
            offset: 12,
            envelope: parked_envelope("no-route", Some("orders"), 0, props, b"x"),
            resolution: None,
            body_apart: None,
        };
        let table = render_table(std::slice::from_ref(&entry));
        assert!(table.starts_with("OFFSET"), "{table}");
        let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(
            row,
            [
                "12",
                "1970-01-01T00:00:00Z",
                "default",
                "no-route",
                "orders",
                "3",
                "m-1"
            ]
        );
        assert!(!table.contains("RESOLUTION"));
        entry.resolution = Some(Resolution {
            format: RESOLUTION_FORMAT.into(),
            resolves: 12,
            action: Action::Discarded,
            by: "ops".into(),
            at_ms: 0,
            to: None,
            edit: None,
        });
        assert!(render_table(&[entry]).contains("discarded by ops"));
    }

    #[test]
    fn counts_render_as_two_aligned_tables() {
        let counts = Counts {
            total: 5,
            by_destination: vec![("orders".into(), 4), ("-".into(), 1)],
            by_reason: vec![("max-attempts".into(), 5)],
        };
        assert_eq!(
            render_counts(&counts),
            "REASON            COUNT\nmax-attempts          5\n\n\
             DESTINATION      COUNT\norders               4\n-                    1\n\n"
        );
        let odd = Counts {
            total: 1,
            by_destination: vec![("q\u{1b}[2J".into(), 1)],
            by_reason: vec![],
        };
        let shown = render_counts(&odd);
        assert!(shown.contains("q\\u{1b}[2J  ") && !shown.contains('\u{1b}'), "{shown}");
    }

    #[test]
    fn show_prints_text_or_hex_bodies() {
        let props = BasicProperties::default().with_headers(header_table(&[("n", FieldValue::LongInt(7))]));
        let mut entry = ParkedEntry {
            offset: 3,
            envelope: parked_envelope("no-route", Some("orders"), 0, props.clone(), b"hello"),
            resolution: None,
            body_apart: None,
        };
        let text = render_entry("s", &entry);
        assert!(
            text.contains("entry        s@3") && text.contains("body (5 bytes, text)\nhello"),
            "{text}"
        );
        assert!(text.contains("n (long-int) = 7"), "{text}");
        entry.envelope = parked_envelope("no-route", Some("orders"), 0, props.clone(), &[0, 1, 0xff]);
        assert!(render_entry("s", &entry).contains("body (3 bytes, hex)\n00000000  00 01 ff"));
        // valid UTF-8 with control characters is not shown as text either
        entry.envelope = parked_envelope("no-route", Some("orders"), 0, props, b"\x00\x1b[2Jbin");
        assert!(
            render_entry("s", &entry).contains("body (8 bytes, hex)\n00000000  00 1b 5b 32 4a 62 69 6e"),
            "{}",
            render_entry("s", &entry)
        );
        assert_eq!(body_text(b"line\r\n\ttabbed \xc3\xbc"), Some("line\r\n\ttabbed \u{fc}"));
    }

    #[test]
    fn times_out_of_range_render_as_the_number() {
        assert_eq!(format_time(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_time(253_402_300_799_999), "9999-12-31T23:59:59Z");
        for ms in OUT_OF_RANGE_TIMES {
            let text = format_time(ms);
            assert!(text.contains(&ms.to_string()) && text.contains("9999"), "{text}");
        }
    }

    #[test]
    fn entries_with_times_out_of_range_render() {
        for ms in OUT_OF_RANGE_TIMES {
            let entry = entry_at(ms);
            let shown = render_entry("s", &entry);
            for line in ["first failed", "failed at", "parked at", "replayed to orders by ops at"] {
                let line = shown.lines().find(|l| l.contains(line)).unwrap_or_default();
                assert!(line.contains(&ms.to_string()), "{line:?} in\n{shown}");
            }
            let table = render_table(std::slice::from_ref(&entry));
            assert_eq!(table.matches(&ms.to_string()).count(), 2, "{table}");
        }
    }

    #[test]
    fn pretty_json_indents_as_serde_json_does_up_to_a_depth() {
        for value in [
            serde_json::json!({"a": [1, {"b": [], "c": {}}, [[]]], "d": "x", "e": null}),
            serde_json::json!([]),
            serde_json::json!("text"),
            serde_json::to_value(odd_entry()).unwrap(),
        ] {
            let (ours, theirs) = (
                pretty_json(&value).unwrap(),
                serde_json::to_string_pretty(&value).unwrap(),
            );
            if theirs.chars().any(hidden) {
                // what serde_json writes raw (the odd entry's C1 and bidi) is escaped, the same value
                assert!(!ours.chars().any(|c| hidden(c) && c != '\n'), "{ours}");
                assert_eq!(serde_json::from_str::<Value>(&ours).unwrap(), value);
            } else {
                assert_eq!(ours, theirs);
            }
        }
        // 24 000 levels: a few lines of at most 64 spaces a level, not 2 × depth (2.3 GB)
        let deep = crate::model::envelope::Envelope::from_slice(&deep_record(DEEP_LEVELS, "orders"));
        let text = std::thread::Builder::new()
            .stack_size(crate::DEEP_STACK_BYTES)
            .spawn(move || pretty_json(&deep.unwrap()).unwrap())
            .unwrap()
            .join()
            .unwrap();
        assert!(text.len() < DEEP_LEVELS * 400, "{} bytes", text.len());
        let indent = "  ".repeat(MAX_JSON_INDENT);
        assert!(
            text.contains(&format!("\n{indent}\"bottom\""))
                || text.contains(&format!("\n{indent}\"value\": \"bottom\""))
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 128,
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Any entries a lot can hold — any JSON in the properties and headers, any numbers for
        /// times and attempts, any text — render as a table, in full and as JSON, and nothing
        /// from them reaches the terminal as a raw control character (but a text body's tabs and
        /// carriage returns).
        #[test]
        fn any_entry_renders(entries in proptest::collection::vec(crate::model::envelope::testing::parked_entry(), 1..4)) {
            let table = render_table(&entries);
            let raw = |text: &str| -> Vec<char> {
                text.chars().filter(|c| c.is_control() && !matches!(c, '\n' | '\t' | '\r')).collect()
            };
            proptest::prop_assert!(raw(&table).is_empty(), "{:?} in\n{}", raw(&table), table);
            proptest::prop_assert_eq!(table.lines().count(), entries.len() + 1);
            for entry in &entries {
                let shown = render_entry("s", entry);
                proptest::prop_assert!(raw(&shown).is_empty(), "{:?} in\n{}", raw(&shown), shown);
                let json = pretty_json(entry).unwrap();
                proptest::prop_assert!(raw(&json).is_empty(), "{:?} in\n{}", raw(&json), json);
                let parsed: serde_json::Value = serde_json::from_str(&json).unwrap();
                proptest::prop_assert_eq!(parsed, serde_json::to_value(entry).unwrap());
            }
        }
    }

    #[test]
    fn odd_values_render_without_a_raw_control_character() {
        let entry = odd_entry();
        let long = format!("long (long-string) = \"{}\"", "x".repeat(LONG));
        let full = render_entry("s", &entry);
        assert!(full.contains(&long));
        let shown = full.replace(&long, "long …");
        let table = render_table(std::slice::from_ref(&entry));
        for text in [&shown, &table] {
            let raw: Vec<char> = text
                .chars()
                .filter(|c| (c.is_control() && *c != '\n') || *c == '\u{202e}')
                .collect();
            assert!(raw.is_empty(), "raw {raw:?} in\n{text}");
        }
        for expected in [
            "reason       max-attempts\\u{1b}[2J",
            "detail       line one\\nline two\\r\\0\\u{9b}",
            "destination  or\\nders",
            "attempts     18446744073709551615",
            "(hop du\\u{7}e)",
            "discarded by o\\u{1b}ps",
            "message_id = \"id-\u{fffd}\\u001b[2J\" (bytes, base64 \"aWQt/xtbMko=\")",
            "app_id = {\"base64\":\"not base64!\"}",
            "\\u{1b}[2Jkey = \"\\u001b[2J\" (bytes, base64 \"G1sySg==\")",
            "correlation_id = \"c\\u0007\\u{202e}1\"",
            "priority = 1e+300",
            "k\u{fffd}\\0 (double) = \"NaN\"",
            "k (float) = \"inf\"",
            "k (double) = \"-inf\"",
            "\\u{1b}]0;title\\u{7} (long-string) = \"a\\nb\\u001b[31m\\u{9b}\"",
            "bin (long-string) = base64 \"/wAb\"",
            "max (long-long-int) = -9223372036854775808",
            "body (8 bytes, hex)",
        ] {
            assert!(shown.contains(expected), "{expected:?} not in\n{shown}");
        }
        let row = table.lines().nth(1).unwrap();
        assert!(
            row.contains("id-\u{fffd}\\u{1b}[2J") && row.contains("or\\nders"),
            "{row}"
        );
    }

    #[test]
    fn json_for_the_terminal_escapes_what_serde_json_leaves_raw() {
        let value = serde_json::json!({"k\u{9b}": "a\u{1b}[2J\u{7f}\u{9b}2J\u{202e}x\u{2066}ü"});
        let json = pretty_json(&value).unwrap();
        assert_eq!(
            json,
            "{\n  \"k\\u009b\": \"a\\u001b[2J\\u007f\\u009b2J\\u202ex\\u2066ü\"\n}"
        );
        assert_eq!(serde_json::from_str::<serde_json::Value>(&json).unwrap(), value);
        // bidirectional marks, zero-width and other invisible format characters too; a tag
        // character (outside the BMP) as its surrogate pair
        let value = serde_json::json!(["\u{61c}\u{200e}\u{200f}\u{200b}\u{feff}\u{ad}\u{2028}\u{e0041}é✓"]);
        let json = pretty_json(&value).unwrap();
        assert_eq!(
            json,
            "[\n  \"\\u061c\\u200e\\u200f\\u200b\\ufeff\\u00ad\\u2028\\udb40\\udc41é✓\"\n]"
        );
        assert_eq!(serde_json::from_str::<serde_json::Value>(&json).unwrap(), value);
        assert!(!printable("\u{61c}\u{200f}\u{e0041}").chars().any(hidden));
    }

    #[test]
    fn show_prints_the_history_and_where_it_was_replayed_from() {
        let mut entry = ParkedEntry {
            offset: 9,
            envelope: parked_envelope("max-attempts", Some("orders"), 0, BasicProperties::default(), b""),
            resolution: None,
            body_apart: None,
        };
        let plain = render_entry("s", &entry);
        assert!(
            !plain.contains("history") && !plain.contains("replayed from"),
            "{plain}"
        );
        entry.envelope.history = vec![
            HistoryEntry {
                attempt: 1,
                tier: "1s".into(),
                failed_at_ms: 1_000,
            },
            HistoryEntry {
                attempt: 2,
                tier: "10s".into(),
                failed_at_ms: 2_500,
            },
        ];
        entry.envelope.replayed_from = Some("s@3".into());
        let text = render_entry("s", &entry);
        assert!(
            text.contains(
                "replayed from s@3\nhistory\n\
                 \x20 attempt 1  tier 1s   failed at 1970-01-01T00:00:01Z\n\
                 \x20 attempt 2  tier 10s  failed at 1970-01-01T00:00:02Z\nparked at"
            ),
            "{text}"
        );
    }
}
