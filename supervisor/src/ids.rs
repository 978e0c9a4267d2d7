//! Unguessable identifiers (execution ids, tokens) from the kernel's CSPRNG.

use std::io::Read;

/// Fills `buf` from the kernel's CSPRNG: getrandom(2), one system call
/// (a kernel's 5 messages a cell each take an id, and opening
/// /dev/urandom for each was a sixth of its shell thread's time), else
/// /dev/urandom. False if neither could.
fn fill_random(buf: &mut [u8]) -> bool {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a valid, writable buffer of `rest.len()` bytes
        // for the duration of the call; getrandom writes at most that many.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n > 0 {
            done += n as usize;
        } else if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        } else {
            break;
        }
    }
    done == buf.len()
        || std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(buf))
            .is_ok()
}

/// `n` random bytes as lowercase hex.
pub fn random_hex(n: usize) -> String {
    let mut buf = vec![0u8; n];
    if !fill_random(&mut buf) {
        // The kernel's CSPRNG is always there on Linux; fall back to time
        // and pid so ids stay unique even in a stripped-down environment.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let seed = t ^ ((std::process::id() as u128) << 64);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (seed >> ((i % 16) * 8)) as u8 ^ i as u8;
        }
    }
    hex(&buf)
}

/// `bytes` as lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(2 * bytes.len());
    for &b in bytes {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 15)]));
    }
    out
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
        let h = super::random_hex(3);
        assert_eq!(h.len(), 6);
        assert!(h
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        // 64 random bits: two alike would be a broken source.
        assert_ne!(super::random_hex(8), super::random_hex(8));
    }
}
