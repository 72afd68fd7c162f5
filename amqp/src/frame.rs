//! Frames: the unit of the AMQP 0-9-1 wire (type, channel, size, payload, end octet).

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// A method frame.
pub const METHOD: u8 = 1;
/// A content header frame.
pub const HEADER: u8 = 2;
/// A content body frame.
pub const BODY: u8 = 3;
/// A heartbeat frame.
pub const HEARTBEAT: u8 = 8;
/// Every frame ends with this octet.
pub const FRAME_END: u8 = 0xCE;
/// Type, channel and size.
pub const FRAME_HEADER_LEN: usize = 7;
/// Header plus end octet: what a frame costs beyond its payload.
pub const FRAME_OVERHEAD: usize = FRAME_HEADER_LEN + 1;
/// The protocol header a client opens with.
pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// [`METHOD`], [`HEADER`], [`BODY`] or [`HEARTBEAT`].
    pub kind: u8,
    /// 0 for the connection.
    pub channel: u16,
    /// The payload.
    pub payload: Bytes,
}

/// A frame that breaks the framing itself; the connection cannot continue.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The end octet is wrong.
    #[error("frame end octet is {0:#04x}, not 0xce")]
    BadEnd(u8),
    /// The size exceeds the negotiated maximum.
    #[error("a frame of {size} bytes exceeds frame_max {max}")]
    TooLarge {
        /// Announced size.
        size: usize,
        /// Negotiated maximum.
        max: usize,
    },
}

/// Takes one whole frame off the front of `buf`, or `None` if it has not all arrived.
pub fn parse(buf: &mut BytesMut, frame_max: usize) -> Result<Option<Frame>, FrameError> {
    if buf.len() < FRAME_HEADER_LEN {
        return Ok(None);
    }
    let size = u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]) as usize;
    if size + FRAME_OVERHEAD > frame_max {
        return Err(FrameError::TooLarge { size, max: frame_max });
    }
    if buf.len() < size + FRAME_OVERHEAD {
        buf.reserve(size + FRAME_OVERHEAD - buf.len());
        return Ok(None);
    }
    let end = buf[FRAME_HEADER_LEN + size];
    if end != FRAME_END {
        return Err(FrameError::BadEnd(end));
    }
    let kind = buf[0];
    let channel = u16::from_be_bytes([buf[1], buf[2]]);
    buf.advance(FRAME_HEADER_LEN);
    let payload = buf.split_to(size).freeze();
    buf.advance(1);
    Ok(Some(Frame { kind, channel, payload }))
}

/// Appends a frame whose payload `write` produces.
pub fn put(out: &mut BytesMut, kind: u8, channel: u16, write: impl FnOnce(&mut BytesMut)) {
    out.put_u8(kind);
    out.put_u16(channel);
    let at = out.len();
    out.put_u32(0);
    write(out);
    let size = (out.len() - at - 4) as u32;
    out[at..at + 4].copy_from_slice(&size.to_be_bytes());
    out.put_u8(FRAME_END);
}

/// Appends a heartbeat frame.
pub fn put_heartbeat(out: &mut BytesMut) {
    out.put_slice(&[HEARTBEAT, 0, 0, 0, 0, 0, 0, FRAME_END]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_split_at_their_boundaries() {
        let mut out = BytesMut::new();
        put(&mut out, METHOD, 7, |b| b.put_slice(b"abc"));
        put_heartbeat(&mut out);
        let whole = out.clone();
        for cut in 0..whole.len() {
            let mut buf = BytesMut::from(&whole[..cut]);
            let mut got = Vec::new();
            while let Some(f) = parse(&mut buf, 4096).unwrap() {
                got.push(f);
            }
            buf.extend_from_slice(&whole[cut..]);
            while let Some(f) = parse(&mut buf, 4096).unwrap() {
                got.push(f);
            }
            assert_eq!(got.len(), 2, "cut at {cut}");
            assert_eq!(got[0].channel, 7);
            assert_eq!(&got[0].payload[..], b"abc");
            assert_eq!(got[1].kind, HEARTBEAT);
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn broken_framing_is_an_error() {
        let mut buf = BytesMut::from(&[1u8, 0, 0, 0, 0, 0, 1, b'x', 0][..]);
        assert_eq!(parse(&mut buf, 4096), Err(FrameError::BadEnd(0)));
        let mut buf = BytesMut::from(&[1u8, 0, 0, 0, 1, 0, 0][..]);
        assert!(matches!(parse(&mut buf, 4096), Err(FrameError::TooLarge { .. })));
    }
}
