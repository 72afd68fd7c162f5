//! The records of a parked stream, other than the parked envelope itself
//! ([`crate::model::envelope`]): resolutions (what an operator did to an entry), markers, and
//! an entry as the operator tools show it. Formats are documented in README and only ever
//! gain fields.

use ladder_amqp::FieldTable;
use serde::{Deserialize, Serialize};

use crate::model::envelope::{self, Envelope, EnvelopeError};
use crate::model::lot::edit::EditAudit;

/// The `type` property and `format` field of a resolution record.
pub const RESOLUTION_FORMAT: &str = "ladder.resolution/v1";

/// The `type` property and `format` field of a marker record: appended by a replay or discard
/// after it took the operator lock, so that reading up to the marker is reading everything that
/// was in the stream before it — every earlier resolution included — without trusting a timing
/// guess about where the stream ends. Readers skip markers.
pub const MARKER_FORMAT: &str = "ladder.marker/v1";

/// A marker record's body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Marker {
    /// Always [`MARKER_FORMAT`].
    pub format: String,
    /// Unique per marker.
    pub id: String,
    /// Who was acting.
    pub by: String,
}

/// What an operator did to an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Republished (confirmed by the broker) to `to`.
    Replayed,
    /// Marked as handled without republishing.
    Discarded,
}

/// A resolution record: the body of a [`RESOLUTION_FORMAT`] record in the parked stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Resolution {
    /// Always [`RESOLUTION_FORMAT`].
    #[schema(schema_with = format_schema)]
    pub format: String,
    /// The stream offset of the entry it resolves.
    pub resolves: u64,
    /// What was done.
    pub action: Action,
    /// Who asked (`$USER`, `--by`, or the HTTP caller).
    pub by: String,
    /// When, ms since the epoch.
    pub at_ms: u64,
    /// The queue it was replayed to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// For a replay edited first: what the edit changed (header keys, the body's length and
    /// SHA-256); the entry itself keeps the original.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edit: Option<EditAudit>,
}

fn format_schema() -> utoipa::openapi::Object {
    crate::model::words_schema([RESOLUTION_FORMAT])
}

/// One parked message as read from the stream.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ParkedEntry {
    /// Its offset in the stream: the entry's identity.
    pub offset: u64,
    /// The record.
    pub envelope: Envelope,
    /// How it was resolved, if it was (the newest resolution wins).
    pub resolution: Option<Resolution>,
    /// A body stored apart from the envelope, when it was read back ([`ParkingLot::show`]
    /// reads it; lists do not). Not serialized: the API serves it at `…/parked/{offset}/body`.
    ///
    /// [`ParkingLot::show`]: crate::broker::lot::ParkingLot::show
    #[serde(skip)]
    pub body_apart: Option<Vec<u8>>,
}

impl ParkedEntry {
    /// The original body: the envelope's, or the one stored apart if it was read back.
    pub fn body(&self) -> Result<std::borrow::Cow<'_, [u8]>, EnvelopeError> {
        match &self.body_apart {
            Some(bytes) => Ok(std::borrow::Cow::Borrowed(bytes)),
            None => self.envelope.message.body().map(std::borrow::Cow::Owned),
        }
    }
}

/// The original headers of an envelope as an AMQP table (for tests and tools comparing a
/// replayed message with its record).
pub fn original_headers(e: &Envelope) -> Result<FieldTable, EnvelopeError> {
    match e.message.properties.get("headers") {
        Some(headers) => envelope::table_from_json(headers),
        None => Ok(FieldTable::default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::envelope::testing::header_table;
    use crate::model::protocol::{self, header, long_string};
    use ladder_amqp::{BasicProperties, FieldValue};

    #[test]
    fn resolution_record_format_is_stable() {
        let r = Resolution {
            format: RESOLUTION_FORMAT.into(),
            resolves: 7,
            action: Action::Replayed,
            by: "ops".into(),
            at_ms: 9,
            to: Some("orders".into()),
            edit: None,
        };
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"format": "ladder.resolution/v1", "resolves": 7, "action": "replayed",
                               "by": "ops", "at_ms": 9, "to": "orders"})
        );
        let crate::model::lot::index::Indexed::Resolution(back) =
            crate::model::lot::index::decode(Some(RESOLUTION_FORMAT), json.to_string().as_bytes()).unwrap()
        else {
            panic!("not a resolution")
        };
        assert_eq!(back, r);
    }

    #[test]
    fn replay_properties_start_a_fresh_count_and_keep_lineage() {
        let props = BasicProperties::default()
            .with_message_id("m")
            .with_user_id("alice")
            .with_expiration("1000")
            .with_headers(header_table(&[
                ("retry-attempt", FieldValue::LongLongInt(3)),
                ("retry-tier", long_string("1s")),
                ("retry-due-at", FieldValue::LongLongInt(5)),
                ("retry-ladder", long_string("default")),
                ("retry-first-failed-at", FieldValue::LongLongInt(1)),
                ("retry-to", long_string("orders")),
                ("x-death", FieldValue::FieldArray(Default::default())),
                ("tenant", long_string("acme")),
            ]));
        let out = protocol::replay_properties(&props, &[(header::RETRY_REPLAYED_FROM, long_string("s@1"))]);
        let h = out.headers.as_ref().unwrap();
        for gone in ["retry-attempt", "retry-tier", "retry-due-at", "retry-ladder", "x-death"] {
            assert!(!h.contains_key(gone), "{gone} kept");
        }
        for kept in ["retry-first-failed-at", "retry-to", "tenant", "retry-replayed-from"] {
            assert!(h.contains_key(kept), "{kept} dropped");
        }
        assert_eq!(h.get("retry-original-user-id"), Some(&long_string("alice")));
        assert!(out.user_id.is_none() && out.expiration.is_none());
        assert_eq!(out.delivery_mode, Some(2));
        assert_eq!(out.message_id.as_ref().and_then(|m| m.to_str()), Some("m"));
    }
}
