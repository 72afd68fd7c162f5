//! AMQP 0-9-1 field values, as RabbitMQ encodes them, with their wire codec.
//!
//! Strings are bytes. The specification calls short strings UTF-8, but RabbitMQ, pika and the
//! Java client pass any bytes through. A decoder that insisted on UTF-8 would fail a whole frame,
//! and with it the connection, for one odd `message_id`. Here nothing a broker
//! sends is refused for its text; callers ask [`ShortString::to_str`] when they need text.
//!
//! The table type codes are RabbitMQ's (its errata to the 0-9-1 specification): `s` is a signed
//! 16-bit integer, not a short string, and there is no short-string field type at all.

use std::borrow::Cow;
use std::fmt;

use bytes::{BufMut, BytesMut};

/// Nesting of tables and arrays deeper than this is not decoded: the content header is kept as
/// raw bytes instead ([`crate::Undecodable`]). It bounds the recursion of every function that
/// walks a value (decode, encode, compare, drop) far below any thread's stack, while staying
/// above what a real application nests (a consumer's headers rarely nest more than 3 levels).
pub const MAX_DEPTH: usize = 64;

/// A value longer than a short string may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a short string has at most 255 bytes, this one {0}")]
pub struct TooLong(pub usize);

/// An AMQP short string: at most 255 bytes, any bytes. A name known when the program is built
/// ([`ShortString::from_static`], or a table key in [`share_table_keys`]) is borrowed, not
/// allocated: making, cloning and dropping it costs no allocation.
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShortString(Cow<'static, [u8]>);

/// Table keys decoded as borrowed [`ShortString`]s: RabbitMQ's own annotations, then what
/// [`share_table_keys`] added.
static SHARED_KEYS: std::sync::OnceLock<SharedKeys> = std::sync::OnceLock::new();

/// Slots of [`SharedKeys`]: a power of two, at least four times the keys it may hold.
const SHARED_SLOTS: usize = 256;

/// The shared keys, in an open-addressed table. A lookup hashes a key's length and three of its
/// bytes and compares a few candidates, so a key that is not shared costs as little as one
/// that is.
struct SharedKeys {
    slots: Box<[Option<&'static [u8]>; SHARED_SLOTS]>,
}

impl SharedKeys {
    fn slot(key: &[u8]) -> usize {
        let (first, last, middle) = match key {
            [] => (0, 0, 0),
            [only] => (*only, *only, *only),
            _ => (key[0], key[key.len() - 1], key[key.len() / 2]),
        };
        let h = (key.len() as u32)
            .wrapping_mul(0x9E37_79B1)
            .wrapping_add(u32::from(first).wrapping_mul(0x85EB_CA6B))
            .wrapping_add(u32::from(last).wrapping_mul(0xC2B2_AE35))
            .wrapping_add(u32::from(middle).wrapping_mul(0x27D4_EB2F));
        (h ^ (h >> 15)) as usize % SHARED_SLOTS
    }

    fn new(keys: impl IntoIterator<Item = &'static [u8]>) -> Self {
        let mut slots = Box::new([None; SHARED_SLOTS]);
        let mut held = 0;
        for key in keys {
            let mut at = Self::slot(key);
            loop {
                match slots[at] {
                    Some(k) if k == key => break,
                    Some(_) => at = (at + 1) % SHARED_SLOTS,
                    None if held < SHARED_SLOTS / 4 => {
                        slots[at] = Some(key);
                        held += 1;
                        break;
                    }
                    None => break, // full enough: the rest are decoded as copies
                }
            }
        }
        SharedKeys { slots }
    }

    fn get(&self, key: &[u8]) -> Option<&'static [u8]> {
        let mut at = Self::slot(key);
        loop {
            match self.slots[at] {
                None => return None,
                Some(k) if k == key => return Some(k),
                Some(_) => at = (at + 1) % SHARED_SLOTS,
            }
        }
    }
}

/// The headers RabbitMQ adds to a message it dead-letters: the `x-death` table and the
/// first and last death's exchange, queue and reason (4.x).
pub const DEAD_LETTER_HEADERS: &[&str] = &[
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
];

/// The other keys RabbitMQ writes into a message's headers: those inside an `x-death` entry,
/// and the quorum queues' delivery counters.
const BROKER_KEYS: &[&str] = &[
    "count",
    "exchange",
    "queue",
    "reason",
    "routing-keys",
    "time",
    "original-expiration",
    "x-delivery-count",
    "x-acquired-count",
];

/// Makes the table keys `keys` (and RabbitMQ's own annotations) decode without an allocation
/// each: a program that reads and writes the same few header names on every message names them
/// once at start. Only the first call has an effect; returns whether this one did.
pub fn share_table_keys(keys: &[&'static str]) -> bool {
    let all = DEAD_LETTER_HEADERS
        .iter()
        .chain(BROKER_KEYS)
        .chain(keys)
        .filter(|k| k.len() <= 255)
        .map(|k| k.as_bytes());
    SHARED_KEYS.set(SharedKeys::new(all)).is_ok()
}

impl ShortString {
    /// A short string of `bytes`, if there are at most 255 of them.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, TooLong> {
        let bytes = bytes.into();
        if bytes.len() > 255 {
            return Err(TooLong(bytes.len()));
        }
        Ok(ShortString(Cow::Owned(bytes)))
    }

    /// A short string of a name fixed at build time, borrowed.
    ///
    /// # Panics
    /// If `text` is longer than 255 bytes (at compile time in a const).
    pub const fn from_static(text: &'static str) -> Self {
        assert!(text.len() <= 255, "a short string has at most 255 bytes");
        ShortString(Cow::Borrowed(text.as_bytes()))
    }

    /// A table key read from the wire: borrowed if it is a shared key, else copied.
    fn table_key(bytes: &[u8]) -> Self {
        if let Some(shared) = SHARED_KEYS.get()
            && let Some(key) = shared.get(bytes)
        {
            return ShortString(Cow::Borrowed(key));
        }
        ShortString(Cow::Owned(bytes.to_vec()))
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The text, if the bytes are UTF-8.
    pub fn to_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.0).ok()
    }

    /// The text with invalid sequences replaced by U+FFFD.
    pub fn to_string_lossy(&self) -> Cow<'_, str> {
        String::from_utf8_lossy(&self.0)
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for the empty string.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes, owned.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0.into_owned()
    }
}

impl TryFrom<&str> for ShortString {
    type Error = TooLong;
    fn try_from(text: &str) -> Result<Self, TooLong> {
        ShortString::new(text.as_bytes())
    }
}

impl TryFrom<String> for ShortString {
    type Error = TooLong;
    fn try_from(text: String) -> Result<Self, TooLong> {
        ShortString::new(text.into_bytes())
    }
}

impl TryFrom<&[u8]> for ShortString {
    type Error = TooLong;
    fn try_from(bytes: &[u8]) -> Result<Self, TooLong> {
        ShortString::new(bytes)
    }
}

impl TryFrom<Vec<u8>> for ShortString {
    type Error = TooLong;
    fn try_from(bytes: Vec<u8>) -> Result<Self, TooLong> {
        ShortString::new(bytes)
    }
}

impl PartialEq<str> for ShortString {
    fn eq(&self, other: &str) -> bool {
        *self.0 == *other.as_bytes()
    }
}

impl PartialEq<&str> for ShortString {
    fn eq(&self, other: &&str) -> bool {
        *self.0 == *other.as_bytes()
    }
}

impl fmt::Debug for ShortString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.to_str() {
            Some(text) => fmt::Debug::fmt(text, f),
            None => write!(f, "b{:?}", self.to_string_lossy()),
        }
    }
}

impl fmt::Display for ShortString {
    /// Lossy: invalid UTF-8 shows as U+FFFD.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_string_lossy())
    }
}

/// An AMQP long string: any bytes.
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LongString(Vec<u8>);

impl LongString {
    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The text, if the bytes are UTF-8.
    pub fn to_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.0).ok()
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for the empty string.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes, owned.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

impl From<&str> for LongString {
    fn from(text: &str) -> Self {
        LongString(text.as_bytes().to_vec())
    }
}

impl From<String> for LongString {
    fn from(text: String) -> Self {
        LongString(text.into_bytes())
    }
}

impl From<&[u8]> for LongString {
    fn from(bytes: &[u8]) -> Self {
        LongString(bytes.to_vec())
    }
}

impl From<Vec<u8>> for LongString {
    fn from(bytes: Vec<u8>) -> Self {
        LongString(bytes)
    }
}

impl fmt::Debug for LongString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.to_str() {
            Some(text) => fmt::Debug::fmt(text, f),
            None => write!(f, "b{:?}", String::from_utf8_lossy(&self.0)),
        }
    }
}

/// A decimal: `value` × 10^-`scale`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Decimal {
    /// Digits after the point.
    pub scale: u8,
    /// The unscaled value.
    pub value: u32,
}

/// One value in a field table or array, with RabbitMQ's type codes.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldValue {
    /// `t`
    Boolean(bool),
    /// `b`
    ShortShortInt(i8),
    /// `B`
    ShortShortUInt(u8),
    /// `s`
    ShortInt(i16),
    /// `u`
    ShortUInt(u16),
    /// `I`
    LongInt(i32),
    /// `i`
    LongUInt(u32),
    /// `l`
    LongLongInt(i64),
    /// `f`
    Float(f32),
    /// `d`
    Double(f64),
    /// `D`
    Decimal(Decimal),
    /// `S`
    LongString(LongString),
    /// `A`
    FieldArray(Vec<FieldValue>),
    /// `T`: seconds since the epoch.
    Timestamp(u64),
    /// `F`
    FieldTable(FieldTable),
    /// `V`
    Void,
    /// `x`
    ByteArray(Vec<u8>),
}

impl FieldValue {
    /// The RabbitMQ type code.
    pub fn type_code(&self) -> u8 {
        match self {
            FieldValue::Boolean(_) => b't',
            FieldValue::ShortShortInt(_) => b'b',
            FieldValue::ShortShortUInt(_) => b'B',
            FieldValue::ShortInt(_) => b's',
            FieldValue::ShortUInt(_) => b'u',
            FieldValue::LongInt(_) => b'I',
            FieldValue::LongUInt(_) => b'i',
            FieldValue::LongLongInt(_) => b'l',
            FieldValue::Float(_) => b'f',
            FieldValue::Double(_) => b'd',
            FieldValue::Decimal(_) => b'D',
            FieldValue::LongString(_) => b'S',
            FieldValue::FieldArray(_) => b'A',
            FieldValue::Timestamp(_) => b'T',
            FieldValue::FieldTable(_) => b'F',
            FieldValue::Void => b'V',
            FieldValue::ByteArray(_) => b'x',
        }
    }

    /// A long string value of `text`.
    pub fn string(text: &str) -> Self {
        FieldValue::LongString(text.into())
    }

    /// Its size in the wire encoding, type code excluded.
    pub fn encoded_len(&self) -> usize {
        match self {
            FieldValue::Boolean(_) | FieldValue::ShortShortInt(_) | FieldValue::ShortShortUInt(_) => 1,
            FieldValue::ShortInt(_) | FieldValue::ShortUInt(_) => 2,
            FieldValue::LongInt(_) | FieldValue::LongUInt(_) | FieldValue::Float(_) => 4,
            FieldValue::LongLongInt(_) | FieldValue::Double(_) | FieldValue::Timestamp(_) => 8,
            FieldValue::Decimal(_) => 5,
            FieldValue::LongString(s) => 4 + s.len(),
            FieldValue::ByteArray(b) => 4 + b.len(),
            FieldValue::Void => 0,
            FieldValue::FieldTable(t) => t.encoded_len(),
            FieldValue::FieldArray(a) => 4 + a.iter().map(|v| 1 + v.encoded_len()).sum::<usize>(),
        }
    }
}

/// A field table: entries in wire order. Keys are short strings of any bytes; a key that occurs
/// twice is kept twice (lookups find the first), so a table decodes and encodes unchanged.
///
/// Tables compare as maps: the same entries in any order are equal. RabbitMQ 4.x re-encodes the
/// tables it forwards sorted by key, 3.x passes them on as published; neither changes a message.
#[derive(Debug, Clone, Default)]
pub struct FieldTable(Vec<(ShortString, FieldValue)>);

impl PartialEq for FieldTable {
    fn eq(&self, other: &Self) -> bool {
        if self.0.len() != other.0.len() {
            return false;
        }
        if self.0.iter().zip(&other.0).all(|(a, b)| a == b) {
            return true;
        }
        fn sorted(t: &FieldTable) -> Vec<&(ShortString, FieldValue)> {
            let mut entries: Vec<&(ShortString, FieldValue)> = t.0.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            entries
        }
        sorted(self) == sorted(other)
    }
}

impl FieldTable {
    /// An empty table.
    pub fn new() -> Self {
        FieldTable(Vec::new())
    }

    /// An empty table with room for `n` entries.
    pub fn with_capacity(n: usize) -> Self {
        FieldTable(Vec::with_capacity(n))
    }

    /// Appends an entry without looking for `key`: for a caller that knows it is absent (a
    /// table that holds it twice is still valid AMQP; [`FieldTable::get`] reads the first).
    pub fn push(&mut self, key: ShortString, value: FieldValue) {
        self.0.push((key, value));
    }

    /// The first value under `key`.
    pub fn get(&self, key: &str) -> Option<&FieldValue> {
        self.get_bytes(key.as_bytes())
    }

    /// The first value under the key of these bytes.
    pub fn get_bytes(&self, key: &[u8]) -> Option<&FieldValue> {
        self.0.iter().find(|(k, _)| k.as_bytes() == key).map(|(_, v)| v)
    }

    /// True if `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// Sets `key`: replaces the first value under it (dropping any later duplicates) or appends.
    pub fn insert(&mut self, key: ShortString, value: FieldValue) {
        match self.0.iter().position(|(k, _)| *k == key) {
            Some(at) => {
                self.0[at].1 = value;
                let mut seen = false;
                self.0.retain(|(k, _)| {
                    if *k != key {
                        return true;
                    }
                    let keep = !seen;
                    seen = true;
                    keep
                });
            }
            None => self.0.push((key, value)),
        }
    }

    /// Sets `key` (a name of at most 255 bytes, which every name this crate's users pass is).
    ///
    /// # Panics
    /// If `key` is longer than 255 bytes.
    pub fn set(&mut self, key: &str, value: FieldValue) {
        // a key already present is not allocated again (a relay sets the same headers on
        // every pass of a message)
        match self.0.iter().position(|(k, _)| k.as_bytes() == key.as_bytes()) {
            Some(at) => {
                self.0[at].1 = value;
                if self.0[at + 1..].iter().any(|(k, _)| k.as_bytes() == key.as_bytes()) {
                    let mut seen = false;
                    self.0.retain(|(k, _)| {
                        if k.as_bytes() != key.as_bytes() {
                            return true;
                        }
                        let keep = !seen;
                        seen = true;
                        keep
                    });
                }
            }
            None => {
                let key = ShortString::try_from(key).expect("a table key of at most 255 bytes");
                self.0.push((key, value));
            }
        }
    }

    /// Removes every entry under `key`; returns the first removed value.
    pub fn remove(&mut self, key: &str) -> Option<FieldValue> {
        let mut first = None;
        let mut i = 0;
        while i < self.0.len() {
            if self.0[i].0.as_bytes() == key.as_bytes() {
                let (_, v) = self.0.remove(i);
                first.get_or_insert(v);
            } else {
                i += 1;
            }
        }
        first
    }

    /// Keeps the entries for which `keep` is true.
    pub fn retain(&mut self, mut keep: impl FnMut(&ShortString, &FieldValue) -> bool) {
        self.0.retain(|(k, v)| keep(k, v));
    }

    /// The entries in wire order.
    pub fn iter(&self) -> impl Iterator<Item = (&ShortString, &FieldValue)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True if there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Its size in the wire encoding, length prefix included.
    pub fn encoded_len(&self) -> usize {
        4 + self
            .0
            .iter()
            .map(|(k, v)| 1 + k.len() + 1 + v.encoded_len())
            .sum::<usize>()
    }
}

/// Room for the entries a relay adds to a table it built from another one (its own headers: a
/// few), so that they do not grow it again.
const TABLE_SLACK: usize = 8;

impl FromIterator<(ShortString, FieldValue)> for FieldTable {
    /// Allocates once for as many entries as the iterator may yield, plus `TABLE_SLACK`. Growing
    /// entry by entry would reallocate at 4, 8 and 16 entries, which a dead-lettered message's
    /// headers reach.
    fn from_iter<I: IntoIterator<Item = (ShortString, FieldValue)>>(iter: I) -> Self {
        let iter = iter.into_iter();
        let (low, high) = iter.size_hint();
        let mut entries = Vec::with_capacity(high.unwrap_or(low).min(1024) + TABLE_SLACK);
        entries.extend(iter);
        FieldTable(entries)
    }
}

impl IntoIterator for FieldTable {
    type Item = (ShortString, FieldValue);
    type IntoIter = std::vec::IntoIter<(ShortString, FieldValue)>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The input ended inside a value.
    #[error("truncated: needed {needed} more bytes")]
    Truncated {
        /// Bytes missing.
        needed: usize,
    },
    /// A table or array value has a type code RabbitMQ does not define.
    #[error("unknown field type {0:#04x}")]
    UnknownType(u8),
    /// Nesting beyond [`MAX_DEPTH`].
    #[error("tables or arrays nested deeper than {MAX_DEPTH} levels")]
    TooDeep,
    /// A length prefix says more than the enclosing value holds.
    #[error("a length of {0} bytes overruns its container")]
    BadLength(usize),
    /// Anything else malformed.
    #[error("{0}")]
    Malformed(String),
}

/// Reads big-endian AMQP primitives from a byte slice.
#[derive(Debug)]
pub struct Reader<'a> {
    bytes: &'a [u8],
    lossy: bool,
    /// Keys of the outermost table whose values are skipped, not decoded.
    skip: &'static [&'static str],
}

impl<'a> Reader<'a> {
    /// Reads from `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader {
            bytes,
            lossy: false,
            skip: &[],
        }
    }

    /// The same reader, leaving out of the outermost table it reads the entries keyed by one of
    /// `keys`: their values are skipped by their length, not decoded (nor checked for depth).
    /// For headers a consumer would only throw away.
    pub fn skipping(self, keys: &'static [&'static str]) -> Self {
        Reader { skip: keys, ..self }
    }

    /// Reads from `bytes`, replacing a table or array nested beyond [`MAX_DEPTH`] by `Void`
    /// instead of failing (it is skipped by its length, without recursion). For reading what a
    /// message's shallow headers say when the whole could not be decoded.
    pub fn lossy(bytes: &'a [u8]) -> Self {
        Reader {
            bytes,
            lossy: true,
            skip: &[],
        }
    }

    /// What is left.
    pub fn remaining(&self) -> &'a [u8] {
        self.bytes
    }

    /// True if everything was read.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.bytes.len() < n {
            return Err(DecodeError::Truncated {
                needed: n - self.bytes.len(),
            });
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// An octet.
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }

    /// A short.
    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    /// A long.
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    /// A long long.
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    /// A short string.
    pub fn short_string(&mut self) -> Result<ShortString, DecodeError> {
        let len = usize::from(self.u8()?);
        Ok(ShortString(Cow::Owned(self.take(len)?.to_vec())))
    }

    /// A long string.
    pub fn long_string(&mut self) -> Result<LongString, DecodeError> {
        let len = self.u32()? as usize;
        Ok(LongString(self.take(len)?.to_vec()))
    }

    /// A field table.
    pub fn table(&mut self) -> Result<FieldTable, DecodeError> {
        self.table_at(0)
    }

    fn table_at(&mut self, depth: usize) -> Result<FieldTable, DecodeError> {
        if depth >= MAX_DEPTH {
            return Err(DecodeError::TooDeep);
        }
        let len = self.u32()? as usize;
        if len > self.bytes.len() {
            return Err(DecodeError::BadLength(len));
        }
        let mut inner = Reader {
            bytes: self.take(len)?,
            lossy: self.lossy,
            skip: &[],
        };
        let skip = if depth == 0 { self.skip } else { &[] };
        let mut entries = Vec::new();
        while !inner.is_empty() {
            let len = usize::from(inner.u8()?);
            let key = inner.take(len)?;
            if skip.iter().any(|k| k.as_bytes() == key) {
                inner.skip_value()?;
                continue;
            }
            let key = ShortString::table_key(key);
            let value = inner.value_at(depth)?;
            entries.push((key, value));
        }
        Ok(FieldTable(entries))
    }

    /// Steps over one field value by its type and length.
    fn skip_value(&mut self) -> Result<(), DecodeError> {
        let len = match self.u8()? {
            b'V' => 0,
            b't' | b'b' | b'B' => 1,
            b's' | b'u' => 2,
            b'I' | b'i' | b'f' => 4,
            b'D' => 5,
            b'l' | b'd' | b'T' => 8,
            b'S' | b'x' | b'A' | b'F' => self.u32()? as usize,
            other => return Err(DecodeError::UnknownType(other)),
        };
        self.take(len).map(drop)
    }

    fn value_at(&mut self, depth: usize) -> Result<FieldValue, DecodeError> {
        let code = self.u8()?;
        Ok(match code {
            b't' => FieldValue::Boolean(self.u8()? != 0),
            b'b' => FieldValue::ShortShortInt(self.u8()? as i8),
            b'B' => FieldValue::ShortShortUInt(self.u8()?),
            b's' => FieldValue::ShortInt(self.u16()? as i16),
            b'u' => FieldValue::ShortUInt(self.u16()?),
            b'I' => FieldValue::LongInt(self.u32()? as i32),
            b'i' => FieldValue::LongUInt(self.u32()?),
            b'l' => FieldValue::LongLongInt(self.u64()? as i64),
            b'f' => FieldValue::Float(f32::from_bits(self.u32()?)),
            b'd' => FieldValue::Double(f64::from_bits(self.u64()?)),
            b'D' => FieldValue::Decimal(Decimal {
                scale: self.u8()?,
                value: self.u32()?,
            }),
            b'S' => FieldValue::LongString(self.long_string()?),
            b'A' | b'F' if depth + 1 >= MAX_DEPTH && self.lossy => {
                let len = self.u32()? as usize;
                self.take(len)?;
                FieldValue::Void
            }
            b'A' => {
                if depth + 1 >= MAX_DEPTH {
                    return Err(DecodeError::TooDeep);
                }
                let len = self.u32()? as usize;
                if len > self.bytes.len() {
                    return Err(DecodeError::BadLength(len));
                }
                let mut inner = Reader {
                    bytes: self.take(len)?,
                    lossy: self.lossy,
                    skip: &[],
                };
                let mut values = Vec::new();
                while !inner.is_empty() {
                    values.push(inner.value_at(depth + 1)?);
                }
                FieldValue::FieldArray(values)
            }
            b'T' => FieldValue::Timestamp(self.u64()?),
            b'F' => FieldValue::FieldTable(self.table_at(depth + 1)?),
            b'V' => FieldValue::Void,
            b'x' => FieldValue::ByteArray(self.long_string()?.0),
            other => return Err(DecodeError::UnknownType(other)),
        })
    }
}

/// Writes `s` as a short string.
pub fn put_short_string(out: &mut BytesMut, s: &ShortString) {
    out.put_u8(s.len() as u8);
    out.put_slice(s.as_bytes());
}

/// Writes `bytes` as a short string, if it fits.
pub fn put_short_bytes(out: &mut BytesMut, bytes: &[u8]) -> Result<(), TooLong> {
    let len = u8::try_from(bytes.len()).map_err(|_| TooLong(bytes.len()))?;
    out.put_u8(len);
    out.put_slice(bytes);
    Ok(())
}

/// Writes `bytes` as a long string.
pub fn put_long_bytes(out: &mut BytesMut, bytes: &[u8]) {
    out.put_u32(bytes.len() as u32);
    out.put_slice(bytes);
}

/// The headers of a publish that carries entries over from another table (a delivery's)
/// without copying it: the entries of `table` for whose key `keep` says yes, in their order,
/// then those of `then` ([`Channel::basic_publish_carrying`](crate::Channel::basic_publish_carrying)).
#[derive(Clone, Copy)]
pub struct Carried<'a> {
    /// The table the entries come from.
    pub table: &'a FieldTable,
    /// Whether an entry with this key is carried over.
    pub keep: &'a dyn Fn(&[u8]) -> bool,
    /// The publish's own headers, written after them.
    pub then: Option<&'a FieldTable>,
}

impl Carried<'_> {
    /// Every entry of the headers: those carried over, then the own ones.
    pub fn entries(&self) -> impl Iterator<Item = (&ShortString, &FieldValue)> + '_ {
        let carried = self.table.iter().filter(|(k, _)| (self.keep)(k.as_bytes()));
        carried.chain(self.then.into_iter().flat_map(FieldTable::iter))
    }
}

impl std::fmt::Debug for Carried<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.entries()).finish()
    }
}

/// Writes `table`.
pub fn put_table(out: &mut BytesMut, table: &FieldTable) {
    out.reserve(table.encoded_len());
    put_entries(out, table.iter());
}

/// Writes the table `carried` makes. Room is made for its own entries only: walking the
/// carried ones twice would cost more than the buffer's rare growth.
pub(crate) fn put_carried(out: &mut BytesMut, carried: &Carried<'_>) {
    out.reserve(carried.then.map_or(4, FieldTable::encoded_len));
    put_entries(out, carried.entries());
}

/// Writes a table of `entries`.
fn put_entries<'a>(out: &mut BytesMut, entries: impl Iterator<Item = (&'a ShortString, &'a FieldValue)>) {
    let at = out.len();
    out.put_u32(0);
    for (key, value) in entries {
        put_short_string(out, key);
        put_value(out, value);
    }
    let len = (out.len() - at - 4) as u32;
    out[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

fn put_value(out: &mut BytesMut, value: &FieldValue) {
    out.put_u8(value.type_code());
    match value {
        FieldValue::Boolean(b) => out.put_u8(u8::from(*b)),
        FieldValue::ShortShortInt(n) => out.put_i8(*n),
        FieldValue::ShortShortUInt(n) => out.put_u8(*n),
        FieldValue::ShortInt(n) => out.put_i16(*n),
        FieldValue::ShortUInt(n) => out.put_u16(*n),
        FieldValue::LongInt(n) => out.put_i32(*n),
        FieldValue::LongUInt(n) => out.put_u32(*n),
        FieldValue::LongLongInt(n) => out.put_i64(*n),
        FieldValue::Float(f) => out.put_u32(f.to_bits()),
        FieldValue::Double(f) => out.put_u64(f.to_bits()),
        FieldValue::Decimal(d) => {
            out.put_u8(d.scale);
            out.put_u32(d.value);
        }
        FieldValue::LongString(s) => put_long_bytes(out, s.as_bytes()),
        FieldValue::FieldArray(values) => {
            let at = out.len();
            out.put_u32(0);
            for v in values {
                put_value(out, v);
            }
            let len = (out.len() - at - 4) as u32;
            out[at..at + 4].copy_from_slice(&len.to_be_bytes());
        }
        FieldValue::Timestamp(t) => out.put_u64(*t),
        FieldValue::FieldTable(t) => put_table(out, t),
        FieldValue::Void => {}
        FieldValue::ByteArray(b) => put_long_bytes(out, b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(s: &[u8]) -> ShortString {
        ShortString::new(s).unwrap()
    }

    fn every_type() -> FieldTable {
        let mut inner = FieldTable::new();
        inner.insert(key(b"n"), FieldValue::LongLongInt(-5));
        [
            (key(b"t"), FieldValue::Boolean(true)),
            (key(b"b"), FieldValue::ShortShortInt(-3)),
            (key(b"B"), FieldValue::ShortShortUInt(250)),
            (key(b"s"), FieldValue::ShortInt(-300)),
            (key(b"u"), FieldValue::ShortUInt(60000)),
            (key(b"I"), FieldValue::LongInt(-70000)),
            (key(b"i"), FieldValue::LongUInt(4_000_000_000)),
            (key(b"l"), FieldValue::LongLongInt(i64::MIN)),
            (key(b"f"), FieldValue::Float(1.5)),
            (key(b"d"), FieldValue::Double(-2.25)),
            (key(b"D"), FieldValue::Decimal(Decimal { scale: 2, value: 1999 })),
            (key(b"S"), FieldValue::LongString(vec![0xff, 0xfe, b'a'].into())),
            (
                key(b"A"),
                FieldValue::FieldArray(vec![FieldValue::Void, FieldValue::string("x")]),
            ),
            (key(b"T"), FieldValue::Timestamp(1_700_000_000)),
            (key(b"F"), FieldValue::FieldTable(inner)),
            (key(b"V"), FieldValue::Void),
            (key(b"x"), FieldValue::ByteArray(vec![0, 1, 254, 255])),
            (key(&[0xc3, 0x28]), FieldValue::string("key not UTF-8")),
        ]
        .into_iter()
        .collect()
    }

    #[test]
    fn every_rabbitmq_type_round_trips_and_its_length_is_known_in_advance() {
        let table = every_type();
        let mut out = BytesMut::new();
        put_table(&mut out, &table);
        assert_eq!(out.len(), table.encoded_len());
        let mut r = Reader::new(&out);
        assert_eq!(r.table().unwrap(), table);
        assert!(r.is_empty());
    }

    #[test]
    fn skipped_keys_of_the_outermost_table_are_stepped_over_whatever_their_type() {
        let table = every_type();
        let mut out = BytesMut::new();
        put_table(&mut out, &table);
        // each type alone, then all but one
        const EACH: [&str; 16] = [
            "t", "b", "B", "s", "u", "I", "i", "l", "f", "d", "D", "S", "A", "T", "F", "V",
        ];
        for skipped in EACH.iter().chain(["x"].iter()) {
            let keys: &'static [&'static str] = Box::leak(Box::new([*skipped]));
            let mut r = Reader::new(&out).skipping(keys);
            let read = r.table().unwrap();
            assert!(r.is_empty());
            let mut expected = table.clone();
            expected.remove(skipped);
            assert_eq!(read, expected, "{skipped}");
        }
        let mut r = Reader::new(&out).skipping(&EACH);
        let read = r.table().unwrap();
        assert_eq!(read.len(), 2, "x and the key that is not UTF-8: {read:?}");
        assert!(read.get("x").is_some());
        // a nested table's keys are not the headers' own: kept
        let mut nested = FieldTable::new();
        nested.insert(key(b"outer"), FieldValue::FieldTable(every_type()));
        let mut out = BytesMut::new();
        put_table(&mut out, &nested);
        assert_eq!(Reader::new(&out).skipping(&EACH).table().unwrap(), nested);
        // a skipped value is not decoded, so not refused for its depth either
        let mut deep = FieldValue::Void;
        for _ in 0..MAX_DEPTH + 2 {
            deep = FieldValue::FieldArray(vec![deep]);
        }
        let mut t = FieldTable::new();
        t.insert(key(b"x-death"), deep);
        t.insert(key(b"kept"), FieldValue::LongInt(1));
        let mut out = BytesMut::new();
        put_table(&mut out, &t);
        assert!(Reader::new(&out).table().is_err());
        let read = Reader::new(&out).skipping(&["x-death"]).table().unwrap();
        assert_eq!(read.get("kept"), Some(&FieldValue::LongInt(1)));
        assert_eq!(read.len(), 1);
        // a truncated skipped value is an error, not a panic
        let short = &out[..out.len() - 8];
        assert!(Reader::new(short).skipping(&["x-death"]).table().is_err());
    }

    #[test]
    fn rabbitmq_type_codes_are_used() {
        // RabbitMQ's 's' is a signed short; 'l' a signed long long; 'I' signed, 'i' unsigned 32
        let mut out = BytesMut::new();
        let mut t = FieldTable::new();
        t.insert(key(b"a"), FieldValue::ShortInt(-2));
        put_table(&mut out, &t);
        assert_eq!(&out[..], &[0, 0, 0, 5, 1, b'a', b's', 0xff, 0xfe]);
    }

    #[test]
    fn tables_compare_as_maps() {
        let ab: FieldTable = [(key(b"a"), FieldValue::LongInt(1)), (key(b"b"), FieldValue::LongInt(2))]
            .into_iter()
            .collect();
        let ba: FieldTable = [(key(b"b"), FieldValue::LongInt(2)), (key(b"a"), FieldValue::LongInt(1))]
            .into_iter()
            .collect();
        assert_eq!(ab, ba);
        let other: FieldTable = [(key(b"b"), FieldValue::LongInt(3)), (key(b"a"), FieldValue::LongInt(1))]
            .into_iter()
            .collect();
        assert_ne!(ab, other);
        assert_ne!(ab, FieldTable::new());
    }

    #[test]
    fn duplicate_keys_are_kept_on_the_wire_and_insert_replaces_them() {
        let mut t: FieldTable = [
            (key(b"a"), FieldValue::LongInt(1)),
            (key(b"b"), FieldValue::LongInt(2)),
            (key(b"a"), FieldValue::LongInt(3)),
        ]
        .into_iter()
        .collect();
        let mut out = BytesMut::new();
        put_table(&mut out, &t);
        assert_eq!(Reader::new(&out).table().unwrap(), t);
        assert_eq!(t.get("a"), Some(&FieldValue::LongInt(1)));
        t.insert(key(b"a"), FieldValue::LongInt(9));
        assert_eq!(t.len(), 2);
        assert_eq!(t.get("a"), Some(&FieldValue::LongInt(9)));
        assert_eq!(t.remove("a"), Some(FieldValue::LongInt(9)));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn set_replaces_in_place_drops_later_duplicates_and_appends_new_keys() {
        let mut t: FieldTable = [
            (key(b"a"), FieldValue::LongInt(1)),
            (key(b"b"), FieldValue::LongInt(2)),
            (key(b"a"), FieldValue::LongInt(3)),
        ]
        .into_iter()
        .collect();
        t.set("b", FieldValue::LongInt(20));
        assert_eq!(
            t.iter().map(|(k, _)| k.as_bytes()).collect::<Vec<_>>(),
            [b"a", b"b", b"a"]
        );
        t.set("a", FieldValue::LongInt(10));
        let entries: Vec<_> = t.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.clone())).collect();
        assert_eq!(
            entries,
            [
                (b"a".to_vec(), FieldValue::LongInt(10)),
                (b"b".to_vec(), FieldValue::LongInt(20))
            ],
            "the first keeps its place, the duplicate goes"
        );
        t.set("c", FieldValue::LongInt(30));
        assert_eq!(t.len(), 3);
        assert_eq!(t.get("c"), Some(&FieldValue::LongInt(30)));
    }

    #[test]
    fn malformed_input_is_an_error_never_a_panic() {
        // unknown type, truncated value, length overrunning, nesting too deep
        assert_eq!(
            Reader::new(&[0, 0, 0, 3, 1, b'a', b'Z']).table(),
            Err(DecodeError::UnknownType(b'Z'))
        );
        assert!(matches!(
            Reader::new(&[0, 0, 0, 4, 1, b'a', b'l', 0]).table(),
            Err(DecodeError::Truncated { .. })
        ));
        assert_eq!(Reader::new(&[0, 0, 1, 0, 1]).table(), Err(DecodeError::BadLength(256)));
        let mut deep = FieldValue::Void;
        for _ in 0..MAX_DEPTH + 1 {
            let mut t = FieldTable::new();
            t.insert(key(b"n"), deep);
            deep = FieldValue::FieldTable(t);
        }
        let FieldValue::FieldTable(deep) = deep else {
            unreachable!()
        };
        let mut out = BytesMut::new();
        put_table(&mut out, &deep);
        assert_eq!(Reader::new(&out).table(), Err(DecodeError::TooDeep));
    }

    #[test]
    fn a_lossy_reader_skips_what_nests_too_deep() {
        let mut deep = FieldValue::LongInt(1);
        for _ in 0..MAX_DEPTH + 5 {
            deep = FieldValue::FieldArray(vec![deep]);
        }
        let mut t = FieldTable::new();
        t.insert(key(b"to"), FieldValue::string("orders"));
        t.insert(key(b"deep"), deep);
        t.insert(key(b"after"), FieldValue::LongInt(2));
        let mut out = BytesMut::new();
        put_table(&mut out, &t);
        assert_eq!(Reader::new(&out).table(), Err(DecodeError::TooDeep));
        let lossy = Reader::lossy(&out).table().unwrap();
        assert_eq!(lossy.get("to"), Some(&FieldValue::string("orders")));
        assert_eq!(lossy.get("after"), Some(&FieldValue::LongInt(2)));
        let mut depth = 0;
        let mut v = lossy.get("deep").unwrap();
        while let FieldValue::FieldArray(a) = v {
            depth += 1;
            v = &a[0];
        }
        assert_eq!((depth, v), (MAX_DEPTH - 1, &FieldValue::Void));
    }

    #[test]
    fn shared_keys_are_found_and_others_are_not() {
        let keys: Vec<&'static [u8]> = DEAD_LETTER_HEADERS
            .iter()
            .chain(BROKER_KEYS)
            .map(|k| k.as_bytes())
            .collect();
        let shared = SharedKeys::new(keys.iter().copied().chain([&b""[..], b"a", b"retry-to"]));
        for key in keys.iter().chain(&[&b""[..], b"a", b"retry-to"]) {
            assert_eq!(shared.get(key), Some(*key), "{key:?}");
        }
        for other in [&b"x-deaths"[..], b"b", b"retry-tO", b"count ", b"x-death\xff"] {
            assert_eq!(shared.get(other), None, "{other:?}");
        }
        // more keys than it holds: the first ones are kept, the rest not, and lookups end
        let many: Vec<&'static [u8]> = (0..500)
            .map(|i| &*Box::leak(format!("key-{i}").into_bytes().into_boxed_slice()))
            .collect();
        let full = SharedKeys::new(many.iter().copied());
        assert_eq!(full.get(many[0]), Some(many[0]));
        assert_eq!(full.get(b"key-499"), None);
        assert_eq!(full.get(b"not-there"), None);
    }

    #[test]
    fn short_strings_hold_any_bytes_up_to_255() {
        assert!(ShortString::new(vec![0xff; 255]).is_ok());
        assert_eq!(ShortString::new(vec![0; 256]), Err(TooLong(256)));
        let s = ShortString::new(vec![b'a', 0xff]).unwrap();
        assert_eq!(s.to_str(), None);
        assert_eq!(s.to_string_lossy(), "a\u{fffd}");
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = Reader::new(&bytes).table();
        }

        #[test]
        fn decoding_mutated_tables_never_panics(flip in 0usize..400, to in any::<u8>()) {
            let mut out = BytesMut::new();
            put_table(&mut out, &every_type());
            let at = flip % out.len();
            out[at] = to;
            let _ = Reader::new(&out).table();
        }
    }
}
