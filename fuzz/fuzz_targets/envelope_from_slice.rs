//! `Envelope::from_slice` on any bytes, and what the operators' views and a replay then do with
//! the envelope: render it (table, in full, JSON), decode its message, rewrite its properties
//! for a replay. Nothing panics, and an envelope written back reads the same.
#![no_main]

use ladder::envelope::Envelope;
use ladder::parking::{self, ParkedEntry};
use ladder::protocol;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(envelope) = Envelope::from_slice(data) else {
        return;
    };
    let entry = ParkedEntry {
        offset: u64::MAX,
        envelope,
        resolution: None,
    };
    let _ = parking::render_entry("fuzz", &entry);
    let _ = parking::render_table(std::slice::from_ref(&entry));
    let _ = parking::pretty_json(&entry).expect("an envelope serializes");
    let message = &entry.envelope.message;
    let _ = (message.body(), message.exchange_bytes(), message.routing_key_bytes());
    let _ = parking::original_headers(&entry.envelope);
    if let Ok(props) = message.properties() {
        let _ = protocol::replay_properties(&props, &[]);
    }
    let text = serde_json::to_vec(&entry.envelope).expect("an envelope serializes");
    assert_eq!(Envelope::from_slice(&text).expect("it reads back"), entry.envelope);
});
