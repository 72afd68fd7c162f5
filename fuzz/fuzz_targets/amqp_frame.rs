//! `frame::parse` on any byte stream, fed in pieces: never panics, never takes more than it was
//! given, and every frame it returns fits `frame_max`. The first two bytes pick `frame_max` and
//! the size of the pieces.
#![no_main]

use bytes::BytesMut;
use ladder_amqp::frame::{self, FRAME_OVERHEAD};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [max, piece, stream @ ..] = data else {
        return;
    };
    let frame_max = FRAME_OVERHEAD + usize::from(*max) * 16;
    let piece = usize::from(*piece).max(1);
    let mut buf = BytesMut::new();
    let mut taken = 0;
    for chunk in stream.chunks(piece) {
        buf.extend_from_slice(chunk);
        loop {
            let before = buf.len();
            match frame::parse(&mut buf, frame_max) {
                Ok(Some(f)) => {
                    assert!(f.payload.len() + FRAME_OVERHEAD <= frame_max);
                    assert_eq!(before - buf.len(), f.payload.len() + FRAME_OVERHEAD);
                    taken += before - buf.len();
                }
                Ok(None) => {
                    assert_eq!(buf.len(), before);
                    break;
                }
                Err(_) => return,
            }
        }
    }
    assert!(taken <= stream.len());
});
