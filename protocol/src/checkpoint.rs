//! The layout of a checkpoint file, shared by the worker that writes it
//! and the supervisor that reads its manifest without decompressing it:
//! the 8 bytes [`MAGIC`], the state (one LZ4 frame with a content
//! checksum), the manifest (JSON), and the manifest's length (u32, big
//! endian). The manifest comes last because it holds the compressed size.

/// First bytes of every checkpoint file.
pub const MAGIC: &[u8; 8] = b"RVISCK01";

/// Largest manifest accepted when reading a checkpoint.
pub const MAX_MANIFEST_BYTES: usize = 16 << 20;

/// The manifest (JSON bytes) and the compressed state of a checkpoint
/// file, or why the bytes are not one.
pub fn split(all: &[u8]) -> Result<(&[u8], &[u8]), String> {
    let damaged = || "the checkpoint is damaged (not an rvisor checkpoint)".to_string();
    let rest = all.strip_prefix(&MAGIC[..]).ok_or_else(damaged)?;
    if rest.len() < 4 {
        return Err(damaged());
    }
    let (body, len) = rest.split_at(rest.len() - 4);
    let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
    if len > body.len() || len > MAX_MANIFEST_BYTES {
        return Err(damaged());
    }
    let (frame, manifest) = body.split_at(body.len() - len);
    Ok((manifest, frame))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_finds_the_manifest_and_refuses_other_bytes() {
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(b"FRAME");
        f.extend_from_slice(b"{}");
        f.extend_from_slice(&2u32.to_be_bytes());
        assert_eq!(split(&f), Ok((&b"{}"[..], &b"FRAME"[..])));
        assert!(split(b"RVISCK01").is_err());
        assert!(split(b"garbage garbage").is_err());
        let mut bad = MAGIC.to_vec();
        bad.extend_from_slice(&99u32.to_be_bytes());
        assert!(split(&bad).is_err());
    }
}
