//! `Reader::table` (strict and lossy) on any bytes: never panics; a table it reads encodes, and
//! reads back to the same encoding.
#![no_main]

use bytes::BytesMut;
use ladder_amqp::types::{Reader, put_table};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for mut reader in [Reader::new(data), Reader::lossy(data)] {
        let Ok(table) = reader.table() else {
            continue;
        };
        let mut once = BytesMut::new();
        put_table(&mut once, &table);
        assert_eq!(once.len(), table.encoded_len());
        let again = Reader::new(&once).table().expect("an encoded table reads back");
        let mut twice = BytesMut::new();
        put_table(&mut twice, &again);
        assert_eq!(once, twice);
    }
});
