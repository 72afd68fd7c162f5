//! `Method::decode` on any method frame payload: never panics; a method it reads encodes, and
//! reads back to the same encoding.
#![no_main]

use bytes::BytesMut;
use ladder_amqp::method::Method;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(method) = Method::decode(data) else {
        return;
    };
    let mut once = BytesMut::new();
    method.encode(&mut once);
    let again = Method::decode(&once).expect("an encoded method reads back");
    let mut twice = BytesMut::new();
    again.encode(&mut twice);
    assert_eq!(once, twice);
});
