//! How the binary's log lines show their fields: every field, the message included, with its
//! control characters escaped visibly ([`printable`]). A log line names what a message carried
//! (a destination, a parking detail, who replayed it), and `tracing-subscriber` escapes only
//! the message and errors, not a field logged with `%`: an escape sequence in a queue name
//! would otherwise retitle or clear the operator's terminal. The level and target keep their
//! colours; those come from the formatter, not from a field.

use std::fmt::Write as _;

use ladder::model::lot::text::printable;
use tracing_subscriber::field::MakeExt;
use tracing_subscriber::fmt::format::{FormatFields, Writer};

/// The field formatter for `tracing_subscriber::fmt().fmt_fields(..)`: `message` as its text,
/// every other field as `name=value`, separated by spaces, all [`printable`].
pub fn inert_fields() -> impl for<'w> FormatFields<'w> + Send + Sync + 'static {
    tracing_subscriber::fmt::format::debug_fn(
        |writer: &mut Writer<'_>, field: &tracing::field::Field, value: &dyn std::fmt::Debug| {
            let mut text = String::new();
            let _ = write!(text, "{value:?}");
            match field.name() {
                "message" => write!(writer, "{}", printable(&text)),
                name => write!(writer, "{}={}", name.trim_start_matches("r#"), printable(&text)),
            }
        },
    )
    .delimited(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// What a subscriber with [`inert_fields`] writes.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn fields_reach_the_log_escaped_whichever_way_they_are_logged() {
        let captured = Captured::default();
        let sink = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .fmt_fields(inert_fields())
            .with_ansi(true)
            .with_writer(move || sink.clone())
            .finish();
        let attack = "\u{1b}]2;pwned\u{7}\u{1b}[2J\u{9b}";
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(destination = %attack, detail = ?attack, n = 3, "parked {attack}");
        });
        let line = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        // the formatter's own colour codes are `ESC [ … m`; none of the field's bytes remain
        let without_colours = regex::Regex::new("\u{1b}\\[[0-9;]*m").unwrap().replace_all(&line, "");
        assert!(
            !without_colours.chars().any(|c| c.is_control() && c != '\n'),
            "{without_colours:?}"
        );
        for shown in [
            "parked \\u{1b}]2;pwned\\u{7}\\u{1b}[2J\\u{9b}",
            "destination=\\u{1b}]2;pwned",
            "detail=\"\\u{1b}]2;pwned",
            "n=3",
        ] {
            assert!(without_colours.contains(shown), "{shown} not in {without_colours:?}");
        }
    }
}
