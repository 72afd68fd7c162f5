//! `lot_index::decode` on any record: the first byte picks the record's `type`, the rest is its
//! body. It never panics, and it takes a record for an entry exactly when
//! `Envelope::from_slice` reads it (otherwise the index would count entries nobody can show, or
//! hide ones that can be shown).
#![no_main]

use ladder::envelope::{Envelope, FORMAT};
use ladder::lot_index::{Indexed, decode};
use ladder::parking::{MARKER_FORMAT, RESOLUTION_FORMAT};
use libfuzzer_sys::fuzz_target;

const KINDS: [Option<&str>; 5] = [
    None,
    Some(FORMAT),
    Some(RESOLUTION_FORMAT),
    Some(MARKER_FORMAT),
    Some("other/v1"),
];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let kind = KINDS[usize::from(selector) % KINDS.len()];
    let indexed = decode(kind, body);
    if matches!(kind, Some(RESOLUTION_FORMAT | MARKER_FORMAT)) {
        assert!(!matches!(indexed, Ok(Indexed::Entry(_))));
        return;
    }
    let read = Envelope::from_slice(body);
    assert_eq!(
        matches!(indexed, Ok(Indexed::Entry(_))),
        read.is_ok(),
        "index: {:?}, envelope: {:?}",
        indexed.err(),
        read.err()
    );
});
