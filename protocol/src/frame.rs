//! Length-prefixed frames over a byte stream.
//!
//! A frame is a 4-byte big-endian payload length followed by that many bytes
//! of JSON. JSON keeps the wire readable in a debugger and costs a few
//! microseconds per call, far below a process hop.

use serde::de::DeserializeOwned;
use serde::Serialize;
use std::io::{self, Read, Write};

/// Largest payload accepted, in bytes. Big enough for a call's output cap
/// (plots are base64 in the frame) with room to spare; anything larger is a
/// corrupt or hostile stream.
pub const MAX_FRAME_BYTES: usize = 256 * 1024 * 1024;

/// Failure to read or write a frame.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The peer closed the stream at a frame boundary.
    #[error("the peer closed the connection")]
    Closed,
    /// The stream ended or failed in the middle of a frame.
    #[error("failed to transfer a frame: {0}")]
    Io(#[from] io::Error),
    /// A length prefix announced more than [`MAX_FRAME_BYTES`].
    #[error("frame of {0} bytes exceeds the limit of {MAX_FRAME_BYTES} bytes")]
    TooLarge(usize),
    /// The payload is not the JSON the receiver expected.
    #[error("failed to decode a frame: {0}")]
    Decode(#[from] serde_json::Error),
}

/// Serialises `msg` and writes it as one frame, then flushes.
pub fn write_frame<W: Write, T: Serialize>(w: &mut W, msg: &T) -> Result<(), FrameError> {
    let payload = serde_json::to_vec(msg)?;
    if payload.len() > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(payload.len()));
    }
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    buf.extend_from_slice(&payload);
    w.write_all(&buf)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame and decodes it. Returns [`FrameError::Closed`] when the
/// stream ends cleanly before a frame starts.
pub fn read_frame<R: Read, T: DeserializeOwned>(r: &mut R) -> Result<T, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => return Err(FrameError::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(len));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok(serde_json::from_slice(&payload)?)
}

/// Incremental decoder for callers that receive bytes in arbitrary chunks
/// (non-blocking sockets, fuzzers).
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
}

impl FrameDecoder {
    /// A decoder with an empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Returns the next complete frame's payload, if one has arrived.
    pub fn next_payload(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > MAX_FRAME_BYTES {
            return Err(FrameError::TooLarge(len));
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let payload = self.buf[4..4 + len].to_vec();
        self.buf.drain(..4 + len);
        Ok(Some(payload))
    }

    /// Returns and decodes the next complete frame, if one has arrived.
    pub fn next_frame<T: DeserializeOwned>(&mut self) -> Result<Option<T>, FrameError> {
        match self.next_payload()? {
            Some(p) => Ok(Some(serde_json::from_slice(&p)?)),
            None => Ok(None),
        }
    }

    /// Bytes received but not yet returned as a frame.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_through_a_stream() {
        let mut wire = Vec::new();
        write_frame(&mut wire, &serde_json::json!({"a": 1})).unwrap();
        write_frame(&mut wire, &"second").unwrap();
        let mut r = &wire[..];
        let a: serde_json::Value = read_frame(&mut r).unwrap();
        let b: String = read_frame(&mut r).unwrap();
        assert_eq!(a["a"], 1);
        assert_eq!(b, "second");
        assert!(matches!(
            read_frame::<_, String>(&mut r),
            Err(FrameError::Closed)
        ));
    }

    #[test]
    fn truncated_frame_is_an_error_not_a_close() {
        let mut wire = Vec::new();
        write_frame(&mut wire, &"hello").unwrap();
        wire.pop();
        let mut r = &wire[..];
        assert!(matches!(
            read_frame::<_, String>(&mut r),
            Err(FrameError::Io(_))
        ));
    }

    #[test]
    fn oversized_length_is_refused_before_allocating() {
        let wire = u32::MAX.to_be_bytes();
        let mut r = &wire[..];
        assert!(matches!(
            read_frame::<_, String>(&mut r),
            Err(FrameError::TooLarge(_))
        ));
        let mut d = FrameDecoder::new();
        d.push(&wire);
        assert!(matches!(d.next_payload(), Err(FrameError::TooLarge(_))));
    }

    #[test]
    fn decoder_handles_byte_by_byte_arrival() {
        let mut wire = Vec::new();
        write_frame(&mut wire, &vec![1, 2, 3]).unwrap();
        write_frame(&mut wire, &vec![4]).unwrap();
        let mut d = FrameDecoder::new();
        let mut out: Vec<Vec<i32>> = Vec::new();
        for b in wire {
            d.push(&[b]);
            while let Some(f) = d.next_frame().unwrap() {
                out.push(f);
            }
        }
        assert_eq!(out, vec![vec![1, 2, 3], vec![4]]);
        assert_eq!(d.pending(), 0);
    }
}
