//! The 5-byte envelope of Connect streaming: `[flags: u8][length: u32 big-endian][payload]`.

use bytes::{Buf, Bytes, BytesMut};

use super::error::ConnectError;

/// Flag bit: the payload is compressed with the negotiated `connect-content-encoding`.
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Flag bit: this is the EndStream frame (JSON payload, last frame of a response).
pub const FLAG_END_STREAM: u8 = 0x02;

const HEADER_LEN: usize = 5;

/// One decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    pub flags: u8,
    pub payload: Bytes,
}

impl Envelope {
    pub fn is_end_stream(&self) -> bool {
        self.flags & FLAG_END_STREAM != 0
    }

    pub fn is_compressed(&self) -> bool {
        self.flags & FLAG_COMPRESSED != 0
    }
}

/// Frames `payload`. Fails only for a payload over 4 GiB, which the message size limits rule out long before.
pub fn encode(flags: u8, payload: &[u8]) -> Result<Bytes, ConnectError> {
    let len = u32::try_from(payload.len()).map_err(|_| {
        ConnectError::resource_exhausted("message too large for a Connect envelope")
    })?;
    let mut out = BytesMut::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&[flags]);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(payload);
    Ok(out.freeze())
}

/// Incremental decoder: feed it body chunks as they arrive, take whole frames out.
#[derive(Debug)]
pub struct Decoder {
    buf: BytesMut,
    max_payload: usize,
}

impl Decoder {
    /// `max_payload` bounds every frame; a larger declared length is rejected before its bytes are buffered.
    pub fn new(max_payload: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            max_payload,
        }
    }

    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete frame, `Ok(None)` if more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Envelope>, ConnectError> {
        if self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.max_payload {
            return Err(ConnectError::resource_exhausted(format!(
                "message of {len} bytes exceeds the limit of {} bytes",
                self.max_payload
            )));
        }
        if self.buf.len() < HEADER_LEN + len {
            return Ok(None);
        }
        self.buf.advance(HEADER_LEN);
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(Envelope { flags, payload }))
    }

    /// True when no partial frame is buffered.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_flags_then_big_endian_length() {
        let framed = encode(FLAG_END_STREAM, b"{}").unwrap();
        assert_eq!(&framed[..], &[0x02, 0, 0, 0, 2, b'{', b'}']);
    }

    #[test]
    fn decoder_reassembles_split_frames() {
        let mut wire = encode(0, b"hello").unwrap().to_vec();
        wire.extend_from_slice(&encode(FLAG_END_STREAM, b"{}").unwrap());
        let mut d = Decoder::new(16);
        let mut frames = Vec::new();
        for byte in wire {
            d.push(&[byte]);
            while let Some(f) = d.next_frame().unwrap() {
                frames.push(f);
            }
        }
        assert_eq!(frames.len(), 2);
        assert_eq!(&frames[0].payload[..], b"hello");
        assert!(!frames[0].is_end_stream());
        assert!(frames[1].is_end_stream());
        assert!(d.is_empty());
    }

    #[test]
    fn oversized_declared_length_is_rejected_before_buffering() {
        let mut d = Decoder::new(4);
        d.push(&[0, 0, 0, 0, 5]);
        let err = d.next_frame().unwrap_err();
        assert_eq!(err.code, crate::connect::Code::ResourceExhausted);
    }
}
