//! Unguessable identifiers (execution ids, tokens) from the kernel's CSPRNG.

use std::io::Read;

/// `n` random bytes as lowercase hex.
pub fn random_hex(n: usize) -> String {
    let mut buf = vec![0u8; n];
    let filled = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .is_ok();
    if !filled {
        // /dev/urandom is always there on Linux; fall back to time and pid so
        // ids stay unique even in a stripped-down environment.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let seed = t ^ ((std::process::id() as u128) << 64);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (seed >> ((i % 16) * 8)) as u8 ^ i as u8;
        }
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `id` has the form of a session id (`s-HEX`, `NODE.s-HEX`, or
/// any id of letters, digits, `-`, `_` and `.` up to 100 bytes): the one
/// rule for ids a session may be resumed under and stores may key by.
pub fn is_session_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 100
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// A new execution id: 16 random bytes, UUID-shaped.
pub fn execution_id() -> String {
    let h = random_hex(16);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_distinct_and_well_formed() {
        let a = super::execution_id();
        let b = super::execution_id();
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(a.matches('-').count(), 4);
    }
}
