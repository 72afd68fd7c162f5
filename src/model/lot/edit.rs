//! Edit before replay: an operator's change to one parked message's headers or body, checked
//! and applied to the original (which stays in the stream untouched), and the audit of it —
//! which header keys changed and the body's length and SHA-256 before and after — that the
//! replay's resolution record carries ([`crate::model::lot::record::Resolution::edit`]).
//! Values are not copied into the audit: a header or body may hold what an audit log must not.

use ladder_amqp::{FieldTable, FieldValue};
use serde::{Deserialize, Serialize};

use crate::model::lot::Invalid;
use crate::model::protocol::{self, MAX_HEADER_DEPTH, header};

/// Largest edited body accepted, in bytes: the admin server's request bound
/// ([`crate::admin::guard::MAX_BODY_BYTES`]) keeps HTTP edits smaller still; this bounds the CLI's
/// `--edit-body-file` against the broker the same way for every path.
pub const MAX_EDITED_BODY_BYTES: usize = 1024 * 1024;

/// What to change before replaying one entry.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Edit {
    /// The headers to replay with, replacing the original's entirely (from the envelope's JSON
    /// form, [`crate::model::envelope::table_from_json`]).
    pub headers: Option<FieldTable>,
    /// Headers set to a text value after `headers` applied (the CLI's `--edit-header K=V`).
    pub set_headers: Vec<(String, String)>,
    /// The body to replay with.
    pub body: Option<Vec<u8>>,
    /// The largest encoded headers the edit may leave: the service's
    /// `limits.max_header_bytes`, which intake would park a larger message for.
    pub max_header_bytes: usize,
}

/// What an edit changed, as the resolution record keeps it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EditAudit {
    /// Header keys the edit added.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers_added: Vec<String>,
    /// Header keys the edit removed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers_removed: Vec<String>,
    /// Header keys whose value or type the edit changed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers_changed: Vec<String>,
    /// The body before and after, when the edit changed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<BodyChange>,
}

/// A body's length and digest before and after an edit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BodyChange {
    /// The original's length in bytes.
    pub from_bytes: u64,
    /// The original's SHA-256, hex.
    pub from_sha256: String,
    /// The replayed body's length in bytes.
    pub to_bytes: u64,
    /// The replayed body's SHA-256, hex.
    pub to_sha256: String,
}

impl EditAudit {
    /// Whether the edit changed nothing.
    pub fn is_empty(&self) -> bool {
        self.headers_added.is_empty()
            && self.headers_removed.is_empty()
            && self.headers_changed.is_empty()
            && self.body.is_none()
    }

    /// One line for logs and pages: `headers added x; changed y; body 12 → 15 bytes`.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        for (what, keys) in [
            ("added", &self.headers_added),
            ("removed", &self.headers_removed),
            ("changed", &self.headers_changed),
        ] {
            if !keys.is_empty() {
                parts.push(format!("headers {what}: {}", keys.join(", ")));
            }
        }
        if let Some(b) = &self.body {
            parts.push(format!("body {} → {} bytes", b.from_bytes, b.to_bytes));
        }
        if parts.is_empty() {
            "nothing changed".into()
        } else {
            parts.join("; ")
        }
    }
}

/// The SHA-256 of `bytes` in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl Edit {
    /// Whether it asks for no change at all.
    pub fn is_empty(&self) -> bool {
        self.headers.is_none() && self.set_headers.is_empty() && self.body.is_none()
    }

    /// The headers and body to replay with, and what changed; refused (with the reason) when
    /// it changes nothing, when the headers would be larger than `max_header_bytes` or
    /// nest deeper than [`MAX_HEADER_DEPTH`], when a key is empty or longer than a short
    /// string, or the body is over [`MAX_EDITED_BODY_BYTES`]. The `retry-*` headers the
    /// replay rewrites anyway (attempt, tier, due time, ladder) are refused too, so an edit
    /// cannot claim it set them.
    pub fn apply(&self, headers: &FieldTable, body: &[u8]) -> Result<(FieldTable, Vec<u8>, EditAudit), Invalid> {
        if self.is_empty() {
            return Err(Invalid("the edit changes nothing: give headers or a body".into()));
        }
        let mut edited = self.headers.clone().unwrap_or_else(|| headers.clone());
        for (key, value) in &self.set_headers {
            if key.is_empty() || key.len() > 255 {
                return Err(Invalid(format!("a header key must be 1 to 255 bytes, not {key:?}")));
            }
            edited.set(key, protocol::long_string(value));
        }
        for (key, _) in edited.iter() {
            let key = key.to_string_lossy();
            if key.is_empty() {
                return Err(Invalid("a header key must not be empty".into()));
            }
            let rewritten = [
                header::RETRY_ATTEMPT,
                header::RETRY_TIER,
                header::RETRY_DUE_AT,
                header::RETRY_LADDER,
                header::RETRY_REPLAYED_FROM,
            ];
            let original = headers.get(&key);
            if rewritten.contains(&key.as_ref()) && edited.get(&key) != original {
                return Err(Invalid(format!(
                    "{key} is set by the replay itself; an edit cannot change it"
                )));
            }
        }
        match protocol::encoded_table_size(&edited, 0) {
            Err(_) => {
                return Err(Invalid(format!(
                    "the edited headers nest deeper than {MAX_HEADER_DEPTH} levels"
                )));
            }
            Ok(size) if size > self.max_header_bytes => {
                return Err(Invalid(format!(
                    "the edited headers are {size} bytes encoded; at most {} are taken (limits.max_header_bytes)",
                    self.max_header_bytes
                )));
            }
            Ok(_) => {}
        }
        if let Some(new) = &self.body
            && new.len() > MAX_EDITED_BODY_BYTES
        {
            return Err(Invalid(format!(
                "the edited body is {} bytes; at most {MAX_EDITED_BODY_BYTES} are accepted",
                new.len()
            )));
        }
        let mut audit = EditAudit::default();
        for (key, value) in edited.iter() {
            let key_text = key.to_string_lossy().into_owned();
            match headers.get_bytes(key.as_bytes()) {
                None => audit.headers_added.push(key_text),
                Some(old) if !same(old, value) => audit.headers_changed.push(key_text),
                Some(_) => {}
            }
        }
        for (key, _) in headers.iter() {
            if edited.get_bytes(key.as_bytes()).is_none() {
                audit.headers_removed.push(key.to_string_lossy().into_owned());
            }
        }
        let new_body = match &self.body {
            Some(new) if new.as_slice() != body => {
                audit.body = Some(BodyChange {
                    from_bytes: body.len() as u64,
                    from_sha256: sha256_hex(body),
                    to_bytes: new.len() as u64,
                    to_sha256: sha256_hex(new),
                });
                new.clone()
            }
            _ => body.to_vec(),
        };
        if audit.is_empty() {
            return Err(Invalid(
                "the edit changes nothing: the headers and body are the original's".into(),
            ));
        }
        for keys in [
            &mut audit.headers_added,
            &mut audit.headers_removed,
            &mut audit.headers_changed,
        ] {
            keys.sort();
        }
        Ok((edited, new_body, audit))
    }
}

/// The queue an edit sends the message to by changing its `retry-to` (a text value other than
/// the original's), if it does.
pub fn new_destination(original: &FieldTable, edited: &FieldTable) -> Option<String> {
    let to = edited.get(header::RETRY_TO)?;
    if original.get(header::RETRY_TO) == Some(to) {
        return None;
    }
    match to {
        FieldValue::LongString(s) => s.to_str().map(str::to_string),
        _ => None,
    }
}

/// Whether two header values are the same value of the same type (floats by their bits, so
/// a NaN left alone is not a change).
fn same(a: &FieldValue, b: &FieldValue) -> bool {
    match (a, b) {
        (FieldValue::Float(x), FieldValue::Float(y)) => x.to_bits() == y.to_bits(),
        (FieldValue::Double(x), FieldValue::Double(y)) => x.to_bits() == y.to_bits(),
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::envelope::testing::header_table;
    use crate::model::protocol::long_string;

    /// An edit with a 200-byte header limit.
    fn edit() -> Edit {
        Edit {
            max_header_bytes: 200,
            ..Edit::default()
        }
    }

    fn original() -> FieldTable {
        header_table(&[
            ("tenant", long_string("acme")),
            ("retry-to", long_string("orders")),
            ("retry-attempt", FieldValue::LongLongInt(3)),
            ("trace", long_string("t-1")),
        ])
    }

    #[test]
    fn an_edit_reports_the_keys_it_changed_and_the_body_by_length_and_digest() {
        let mut headers = original();
        headers.remove("trace");
        headers.set("tenant", long_string("globex"));
        headers.set("region", long_string("eu"));
        let edit = Edit {
            headers: Some(headers),
            set_headers: vec![("priority".into(), "high".into())],
            body: Some(b"{\"fixed\":true}".to_vec()),
            max_header_bytes: 200,
        };
        let (h, body, audit) = edit.apply(&original(), b"{}").unwrap();
        assert_eq!(new_destination(&original(), &h), None, "retry-to unchanged");
        let mut elsewhere = h.clone();
        elsewhere.set("retry-to", long_string("orders-v2"));
        assert_eq!(new_destination(&original(), &elsewhere).as_deref(), Some("orders-v2"));
        assert_eq!(h.get("priority"), Some(&long_string("high")));
        assert_eq!(body, b"{\"fixed\":true}");
        assert_eq!(audit.headers_added, ["priority", "region"]);
        assert_eq!(audit.headers_removed, ["trace"]);
        assert_eq!(audit.headers_changed, ["tenant"]);
        let b = audit.body.as_ref().unwrap();
        assert_eq!((b.from_bytes, b.to_bytes), (2, 14));
        assert_eq!(
            b.from_sha256,
            "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        );
        assert_eq!(
            audit.summary(),
            "headers added: priority, region; headers removed: trace; headers changed: tenant; body 2 → 14 bytes"
        );
        // and as the resolution record keeps it: empty lists left out
        let json = serde_json::to_value(EditAudit {
            body: None,
            ..audit.clone()
        })
        .unwrap();
        assert_eq!(
            json,
            serde_json::json!({"headers_added": ["priority", "region"], "headers_removed": ["trace"],
                               "headers_changed": ["tenant"]})
        );
    }

    #[test]
    fn edits_that_change_nothing_or_break_a_limit_are_refused_with_the_reason() {
        let refused = |edit: Edit| edit.apply(&original(), b"same").unwrap_err().0;
        assert!(refused(edit()).contains("changes nothing"));
        let same = Edit {
            headers: Some(original()),
            body: Some(b"same".to_vec()),
            ..edit()
        };
        assert!(refused(same).contains("changes nothing"));
        let large = Edit {
            set_headers: vec![("big".into(), "x".repeat(300))],
            ..edit()
        };
        assert!(refused(large).contains("max_header_bytes"), "the ladder's limit");
        let attempt = Edit {
            set_headers: vec![("retry-attempt".into(), "1".into())],
            ..edit()
        };
        assert!(refused(attempt).contains("set by the replay itself"));
        let empty_key = Edit {
            set_headers: vec![(String::new(), "v".into())],
            ..edit()
        };
        assert!(refused(empty_key).contains("1 to 255 bytes"));
        let huge = Edit {
            body: Some(vec![0; MAX_EDITED_BODY_BYTES + 1]),
            ..edit()
        };
        assert!(refused(huge).contains("at most"));
        // removing a header the replay rewrites anyway is no claim: allowed
        let mut without = original();
        without.remove("retry-attempt");
        let (_, _, audit) = Edit {
            headers: Some(without),
            ..edit()
        }
        .apply(&original(), b"same")
        .unwrap();
        assert_eq!(audit.headers_removed, ["retry-attempt"]);
    }
}
