//! The layout of a checkpoint file, shared by the worker that writes it
//! and the supervisor that reads its manifest without decompressing it:
//! the 8 bytes [`MAGIC`], the state (one LZ4 frame with a content
//! checksum), the manifest (JSON), and the manifest's length (u32, big
//! endian). The manifest comes last because it holds the compressed size.
//!
//! Readers find the manifest from the file's tail ([`read_manifest`]) and
//! never read the state to do so, so a checkpoint of any size is looked at
//! in bounded memory.

use std::io::{Read, Seek, SeekFrom};

/// First bytes of every checkpoint file.
pub const MAGIC: &[u8; 8] = b"RVISCK01";

/// Largest manifest accepted when reading a checkpoint.
pub const MAX_MANIFEST_BYTES: usize = 16 << 20;

/// Where the parts of one checkpoint file lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of the whole file.
    pub len: u64,
    /// Offset of the compressed state (right after the magic).
    pub frame_offset: u64,
    /// Bytes of the compressed state.
    pub frame_len: u64,
    /// Bytes of the manifest.
    pub manifest_len: u64,
}

fn damaged() -> String {
    "the checkpoint is damaged (not an rvisor checkpoint)".to_string()
}

/// Reads the layout and the manifest (JSON bytes) of the checkpoint in
/// `f`, from its head and its tail, or says why it is not one. The state
/// is not read; a manifest over [`MAX_MANIFEST_BYTES`] is refused before
/// anything is allocated for it.
pub fn read_manifest<F: Read + Seek>(f: &mut F) -> Result<(Layout, Vec<u8>), String> {
    let io = |e: std::io::Error| format!("could not read the checkpoint ({e})");
    let len = f.seek(SeekFrom::End(0)).map_err(io)?;
    let fixed = MAGIC.len() as u64 + 4;
    if len < fixed {
        return Err(damaged());
    }
    let mut magic = [0u8; 8];
    f.seek(SeekFrom::Start(0)).map_err(io)?;
    f.read_exact(&mut magic).map_err(io)?;
    if &magic != MAGIC {
        return Err(damaged());
    }
    let mut tail = [0u8; 4];
    f.seek(SeekFrom::Start(len - 4)).map_err(io)?;
    f.read_exact(&mut tail).map_err(io)?;
    let manifest_len = u64::from(u32::from_be_bytes(tail));
    if manifest_len > MAX_MANIFEST_BYTES as u64 {
        return Err(format!(
            "the checkpoint is damaged (its manifest claims {manifest_len} bytes, more than \
             the {} MiB a manifest may have)",
            MAX_MANIFEST_BYTES >> 20
        ));
    }
    if manifest_len > len - fixed {
        return Err(damaged());
    }
    let layout = Layout {
        len,
        frame_offset: MAGIC.len() as u64,
        frame_len: len - fixed - manifest_len,
        manifest_len,
    };
    let mut manifest = vec![0u8; manifest_len as usize];
    f.seek(SeekFrom::Start(len - 4 - manifest_len))
        .map_err(io)?;
    f.read_exact(&mut manifest).map_err(io)?;
    Ok((layout, manifest))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn read(b: &[u8]) -> Result<(Layout, Vec<u8>), String> {
        read_manifest(&mut Cursor::new(b))
    }

    #[test]
    fn the_manifest_is_found_from_the_tail_and_other_bytes_are_refused() {
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(b"FRAME");
        f.extend_from_slice(b"{}");
        f.extend_from_slice(&2u32.to_be_bytes());
        let (layout, m) = read(&f).unwrap();
        assert_eq!(m, b"{}");
        assert_eq!(
            layout,
            Layout {
                len: f.len() as u64,
                frame_offset: 8,
                frame_len: 5,
                manifest_len: 2
            }
        );
        assert!(read(b"RVISCK01").is_err());
        assert!(read(b"garbage garbage").is_err());
        let mut bad = MAGIC.to_vec();
        bad.extend_from_slice(&99u32.to_be_bytes());
        assert!(read(&bad).is_err());
    }

    #[test]
    fn a_manifest_that_claims_more_than_the_limit_is_refused_without_reading_it() {
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&u32::MAX.to_be_bytes());
        let e = read(&f).unwrap_err();
        assert!(e.contains("more than the 16 MiB"), "{e}");
    }
}
