//! The basic class's content properties and the content header frame's payload.

use bytes::{BufMut, BytesMut};

use crate::types::{Carried, DecodeError, FieldTable, Reader, ShortString, put_carried, put_short_string, put_table};

/// The properties of a message. Every field is optional; absent ones are not sent.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BasicProperties {
    /// MIME type.
    pub content_type: Option<ShortString>,
    /// MIME encoding.
    pub content_encoding: Option<ShortString>,
    /// Application headers.
    pub headers: Option<FieldTable>,
    /// 1 transient, 2 persistent.
    pub delivery_mode: Option<u8>,
    /// 0 to 9.
    pub priority: Option<u8>,
    /// Correlation id.
    pub correlation_id: Option<ShortString>,
    /// Reply-to address.
    pub reply_to: Option<ShortString>,
    /// Per-message TTL, ms as text.
    pub expiration: Option<ShortString>,
    /// Message id.
    pub message_id: Option<ShortString>,
    /// Seconds since the epoch.
    pub timestamp: Option<u64>,
    /// Message type (`type` on the wire).
    pub kind: Option<ShortString>,
    /// Creating user; RabbitMQ checks it against the publishing connection's user.
    pub user_id: Option<ShortString>,
    /// Creating application.
    pub app_id: Option<ShortString>,
    /// Deprecated in 0-9-1; kept as received.
    pub cluster_id: Option<ShortString>,
}

const CONTENT_TYPE: u16 = 1 << 15;
const CONTENT_ENCODING: u16 = 1 << 14;
const HEADERS: u16 = 1 << 13;
const DELIVERY_MODE: u16 = 1 << 12;
const PRIORITY: u16 = 1 << 11;
const CORRELATION_ID: u16 = 1 << 10;
const REPLY_TO: u16 = 1 << 9;
const EXPIRATION: u16 = 1 << 8;
const MESSAGE_ID: u16 = 1 << 7;
const TIMESTAMP: u16 = 1 << 6;
const TYPE: u16 = 1 << 5;
const USER_ID: u16 = 1 << 4;
const APP_ID: u16 = 1 << 3;
const CLUSTER_ID: u16 = 1 << 2;
/// The flags word continues in another word (never for the basic class).
const CONTINUATION: u16 = 1;

impl BasicProperties {
    /// Appends the property flags and list (the content header after class, weight and size).
    pub fn encode(&self, out: &mut BytesMut) {
        self.encode_carrying(out, None);
    }

    /// [`encode`](Self::encode), with the headers `carried` makes (entries carried over, then
    /// its own) instead of this property list's `headers`.
    pub fn encode_carrying(&self, out: &mut BytesMut, carried: Option<&Carried<'_>>) {
        let mut flags = 0u16;
        let at = out.len();
        out.put_u16(0);
        let mut short = |flag: u16, value: &Option<ShortString>, out: &mut BytesMut| {
            if let Some(v) = value {
                flags |= flag;
                put_short_string(out, v);
            }
        };
        short(CONTENT_TYPE, &self.content_type, out);
        short(CONTENT_ENCODING, &self.content_encoding, out);
        match (carried, &self.headers) {
            (Some(carried), _) => {
                flags |= HEADERS;
                put_carried(out, carried);
            }
            (None, Some(headers)) => {
                flags |= HEADERS;
                put_table(out, headers);
            }
            (None, None) => {}
        }
        if let Some(v) = self.delivery_mode {
            flags |= DELIVERY_MODE;
            out.put_u8(v);
        }
        if let Some(v) = self.priority {
            flags |= PRIORITY;
            out.put_u8(v);
        }
        let mut short = |flag: u16, value: &Option<ShortString>, out: &mut BytesMut| {
            if let Some(v) = value {
                flags |= flag;
                put_short_string(out, v);
            }
        };
        short(CORRELATION_ID, &self.correlation_id, out);
        short(REPLY_TO, &self.reply_to, out);
        short(EXPIRATION, &self.expiration, out);
        short(MESSAGE_ID, &self.message_id, out);
        if let Some(v) = self.timestamp {
            flags |= TIMESTAMP;
            out.put_u64(v);
        }
        let mut short = |flag: u16, value: &Option<ShortString>, out: &mut BytesMut| {
            if let Some(v) = value {
                flags |= flag;
                put_short_string(out, v);
            }
        };
        short(TYPE, &self.kind, out);
        short(USER_ID, &self.user_id, out);
        short(APP_ID, &self.app_id, out);
        short(CLUSTER_ID, &self.cluster_id, out);
        out[at..at + 2].copy_from_slice(&flags.to_be_bytes());
    }

    /// Reads the property flags and list.
    pub fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let flags = r.u16()?;
        if flags & CONTINUATION != 0 {
            return Err(DecodeError::Malformed(
                "property flags continue in a second word".into(),
            ));
        }
        let short = |flag: u16, r: &mut Reader<'_>| -> Result<Option<ShortString>, DecodeError> {
            if flags & flag != 0 {
                Ok(Some(r.short_string()?))
            } else {
                Ok(None)
            }
        };
        let mut p = BasicProperties {
            content_type: short(CONTENT_TYPE, r)?,
            content_encoding: short(CONTENT_ENCODING, r)?,
            ..Default::default()
        };
        if flags & HEADERS != 0 {
            p.headers = Some(r.table()?);
        }
        if flags & DELIVERY_MODE != 0 {
            p.delivery_mode = Some(r.u8()?);
        }
        if flags & PRIORITY != 0 {
            p.priority = Some(r.u8()?);
        }
        p.correlation_id = short(CORRELATION_ID, r)?;
        p.reply_to = short(REPLY_TO, r)?;
        p.expiration = short(EXPIRATION, r)?;
        p.message_id = short(MESSAGE_ID, r)?;
        if flags & TIMESTAMP != 0 {
            p.timestamp = Some(r.u64()?);
        }
        p.kind = short(TYPE, r)?;
        p.user_id = short(USER_ID, r)?;
        p.app_id = short(APP_ID, r)?;
        p.cluster_id = short(CLUSTER_ID, r)?;
        Ok(p)
    }

    /// Sets `content_type`. Like every `with_` method that takes text, it panics above 255
    /// bytes: it is for names the caller controls, not for input.
    pub fn with_content_type(self, v: &str) -> Self {
        BasicProperties {
            content_type: Some(short(v)),
            ..self
        }
    }

    /// Sets `content_encoding`.
    pub fn with_content_encoding(self, v: &str) -> Self {
        BasicProperties {
            content_encoding: Some(short(v)),
            ..self
        }
    }

    /// Sets the headers.
    pub fn with_headers(self, headers: FieldTable) -> Self {
        BasicProperties {
            headers: Some(headers),
            ..self
        }
    }

    /// Sets `delivery_mode` (2: persistent).
    pub fn with_delivery_mode(self, v: u8) -> Self {
        BasicProperties {
            delivery_mode: Some(v),
            ..self
        }
    }

    /// Sets `priority`.
    pub fn with_priority(self, v: u8) -> Self {
        BasicProperties {
            priority: Some(v),
            ..self
        }
    }

    /// Sets `correlation_id`.
    pub fn with_correlation_id(self, v: &str) -> Self {
        BasicProperties {
            correlation_id: Some(short(v)),
            ..self
        }
    }

    /// Sets `reply_to`.
    pub fn with_reply_to(self, v: &str) -> Self {
        BasicProperties {
            reply_to: Some(short(v)),
            ..self
        }
    }

    /// Sets `expiration`.
    pub fn with_expiration(self, v: &str) -> Self {
        BasicProperties {
            expiration: Some(short(v)),
            ..self
        }
    }

    /// Sets `message_id`.
    pub fn with_message_id(self, v: &str) -> Self {
        BasicProperties {
            message_id: Some(short(v)),
            ..self
        }
    }

    /// Sets `timestamp`.
    pub fn with_timestamp(self, v: u64) -> Self {
        BasicProperties {
            timestamp: Some(v),
            ..self
        }
    }

    /// Sets `type`.
    pub fn with_type(self, v: &str) -> Self {
        BasicProperties {
            kind: Some(short(v)),
            ..self
        }
    }

    /// Sets `user_id`.
    pub fn with_user_id(self, v: &str) -> Self {
        BasicProperties {
            user_id: Some(short(v)),
            ..self
        }
    }

    /// Sets `app_id`.
    pub fn with_app_id(self, v: &str) -> Self {
        BasicProperties {
            app_id: Some(short(v)),
            ..self
        }
    }

    /// A copy without the headers, for properties that get headers of their own: cloning the
    /// whole and then replacing the headers would allocate (and free) every key and string value
    /// of a table that is thrown away — on a relay hop, the largest part of the message's
    /// properties (`x-death` and the like).
    pub fn clone_without_headers(&self) -> Self {
        BasicProperties {
            content_type: self.content_type.clone(),
            content_encoding: self.content_encoding.clone(),
            headers: None,
            delivery_mode: self.delivery_mode,
            priority: self.priority,
            correlation_id: self.correlation_id.clone(),
            reply_to: self.reply_to.clone(),
            expiration: self.expiration.clone(),
            message_id: self.message_id.clone(),
            timestamp: self.timestamp,
            kind: self.kind.clone(),
            user_id: self.user_id.clone(),
            app_id: self.app_id.clone(),
            cluster_id: self.cluster_id.clone(),
        }
    }

    /// A copy whose headers are those `carried` makes: what
    /// [`encode_carrying`](Self::encode_carrying) writes, as properties of their own.
    pub fn with_carried(&self, carried: &Carried<'_>) -> Self {
        BasicProperties {
            headers: Some(carried.entries().map(|(k, v)| (k.clone(), v.clone())).collect()),
            ..self.clone_without_headers()
        }
    }

    /// The headers, or an empty table.
    pub fn headers_or_empty(&self) -> std::borrow::Cow<'_, FieldTable> {
        match &self.headers {
            Some(h) => std::borrow::Cow::Borrowed(h),
            None => std::borrow::Cow::Owned(FieldTable::new()),
        }
    }
}

fn short(text: &str) -> ShortString {
    ShortString::try_from(text).expect("a name of at most 255 bytes")
}

/// Properties as they came off the wire: decoded, or — when they could not be — their bytes.
#[derive(Debug, Clone, PartialEq)]
pub enum WireProperties {
    /// Decoded.
    Decoded(Box<BasicProperties>),
    /// The property flags and list exactly as received, and why they did not decode.
    Raw {
        /// The bytes after class, weight and body size.
        bytes: Vec<u8>,
        /// The decoder's complaint.
        error: DecodeError,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::FieldValue;

    fn s(text: &[u8]) -> Option<ShortString> {
        Some(ShortString::new(text).unwrap())
    }

    #[test]
    fn every_property_round_trips_with_any_bytes() {
        let mut headers = FieldTable::new();
        headers.insert(ShortString::new(&b"k\xff"[..]).unwrap(), FieldValue::LongInt(1));
        let p = BasicProperties {
            content_type: s(b"application/json"),
            content_encoding: s(b"gzip"),
            headers: Some(headers),
            delivery_mode: Some(2),
            priority: Some(9),
            correlation_id: s(b"c\xfe"),
            reply_to: s(b"amq.rabbitmq.reply-to"),
            expiration: s(b"1000"),
            message_id: s(b"\xff\xfe\xfd"),
            timestamp: Some(1_700_000_000),
            kind: s(b"t"),
            user_id: s(b"guest"),
            app_id: s(b"a"),
            cluster_id: s(b"c"),
        };
        let mut out = BytesMut::new();
        p.encode(&mut out);
        let mut r = Reader::new(&out);
        assert_eq!(BasicProperties::decode(&mut r).unwrap(), p);
        assert!(r.is_empty());

        let mut out = BytesMut::new();
        BasicProperties::default().encode(&mut out);
        assert_eq!(&out[..], &[0, 0]);

        let bare = p.clone_without_headers();
        assert_eq!(bare.headers, None);
        assert_eq!(
            BasicProperties {
                headers: p.headers.clone(),
                ..bare
            },
            p,
            "everything else is kept"
        );
    }

    #[test]
    fn carried_headers_encode_as_one_table_with_the_own_ones_after() {
        let mut received = FieldTable::new();
        received.insert(ShortString::new(&b"x-death"[..]).unwrap(), FieldValue::LongInt(1));
        received.insert(ShortString::new(&b"k\xff"[..]).unwrap(), FieldValue::LongInt(2));
        received.insert(ShortString::new(&b"kept"[..]).unwrap(), FieldValue::Boolean(true));
        let keep = |k: &[u8]| k != b"x-death";
        let mut own = FieldTable::new();
        own.insert(ShortString::new(&b"own"[..]).unwrap(), FieldValue::LongInt(3));
        let carried = Carried {
            table: &received,
            keep: &keep,
            then: Some(&own),
        };
        let decoded = |p: &BasicProperties, carried: Option<&Carried<'_>>| {
            let mut out = BytesMut::new();
            p.encode_carrying(&mut out, carried);
            let mut r = Reader::new(&out);
            let decoded = BasicProperties::decode(&mut r).unwrap();
            assert!(r.is_empty());
            decoded
        };
        // the properties' own headers give way to the carried ones
        let mut ignored = FieldTable::new();
        ignored.insert(ShortString::new(&b"ignored"[..]).unwrap(), FieldValue::LongInt(4));
        let p = BasicProperties::default().with_delivery_mode(2).with_headers(ignored);
        let key = |k: &[u8]| ShortString::new(k).unwrap();
        let expected = vec![
            (key(b"k\xff"), FieldValue::LongInt(2)),
            (key(b"kept"), FieldValue::Boolean(true)),
            (key(b"own"), FieldValue::LongInt(3)),
        ];
        let got = decoded(&p, Some(&carried));
        let entries: Vec<(ShortString, FieldValue)> = got.headers.clone().unwrap().into_iter().collect();
        assert_eq!(entries, expected, "the kept entries in their order, then the own ones");
        assert_eq!(got.delivery_mode, Some(2));
        assert_eq!(carried.entries().count(), 3);
        assert_eq!(p.with_carried(&carried), got, "the same properties, made as a copy");

        // no own headers: the carried ones alone; nothing kept: an empty table, not none
        let alone = Carried { then: None, ..carried };
        assert_eq!(decoded(&p, Some(&alone)).headers.unwrap().len(), 2);
        let none = |_: &[u8]| false;
        let nothing = Carried {
            table: &received,
            keep: &none,
            then: None,
        };
        assert_eq!(decoded(&p, Some(&nothing)).headers, Some(FieldTable::new()));
        // without carried headers: as `encode`
        let mut plain = BytesMut::new();
        p.encode(&mut plain);
        let mut carrying = BytesMut::new();
        p.encode_carrying(&mut carrying, None);
        assert_eq!(plain, carrying);
    }
}
