//! `BasicProperties::decode` on any bytes: never panics; properties it reads encode and read back
//! to the same encoding, and survive the parked envelope exactly (captured, written as JSON, read
//! back, as a replay does).
#![no_main]

use bytes::BytesMut;
use ladder::envelope::OriginalMessage;
use ladder_amqp::BasicProperties;
use ladder_amqp::types::Reader;
use libfuzzer_sys::fuzz_target;

fn encoded(props: &BasicProperties) -> BytesMut {
    let mut out = BytesMut::new();
    props.encode(&mut out);
    out
}

fuzz_target!(|data: &[u8]| {
    let Ok(props) = BasicProperties::decode(&mut Reader::new(data)) else {
        return;
    };
    let once = encoded(&props);
    let again = BasicProperties::decode(&mut Reader::new(&once)).expect("encoded properties read back");
    assert_eq!(once, encoded(&again));
    let original = OriginalMessage::capture(b"x", b"", &props, b"body");
    let text = serde_json::to_string(&original).expect("an envelope serializes");
    let back: OriginalMessage = serde_json::from_str(&text).expect("it reads back");
    let stored = back.properties().expect("captured properties decode");
    assert_eq!(encoded(&stored), once, "{text}");
});
