//! Output of a process read by background threads until it closes: used for
//! the zygote's stderr, so a zygote that fails to start can say why. (A
//! worker's fds 1 and 2 are read by its I/O thread, see worker.rs.)

use std::io::Read;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

#[derive(Debug, Default)]
struct Buffers {
    data: [Vec<u8>; 2],
    closed: [bool; 2],
}

/// The worker's raw stdout (0) and stderr (1).
#[derive(Debug, Clone, Default)]
pub struct RawOutput {
    inner: Arc<(Mutex<Buffers>, Condvar)>,
}

/// Bytes a stream may hold before older ones are dropped (a flood from a
/// child process must not grow the supervisor without bound).
const MAX_BUFFERED: usize = 16 * 1024 * 1024;

impl RawOutput {
    /// Starts a thread that drains `pipe` into stream `idx`.
    pub fn attach<R: Read + Send + 'static>(&self, idx: usize, mut pipe: R) {
        let me = self.clone();
        std::thread::Builder::new()
            .name(format!("rvisor-raw-{idx}"))
            .spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                loop {
                    let n = match pipe.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    let (lock, cv) = &*me.inner;
                    let mut b = lock.lock().unwrap_or_else(|e| e.into_inner());
                    let d = &mut b.data[idx];
                    d.extend_from_slice(&buf[..n]);
                    if d.len() > MAX_BUFFERED {
                        let cut = d.len() - MAX_BUFFERED;
                        d.drain(..cut);
                    }
                    cv.notify_all();
                }
                let (lock, cv) = &*me.inner;
                lock.lock().unwrap_or_else(|e| e.into_inner()).closed[idx] = true;
                cv.notify_all();
            })
            .expect("spawning a thread");
    }

    /// Waits (until `deadline`) for `token` on both streams and returns what
    /// came before it on each. Streams that closed give all they had.
    pub fn take_until(&self, token: &[u8], deadline: Instant) -> [Vec<u8>; 2] {
        let (lock, cv) = &*self.inner;
        let mut b = lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: [Option<Vec<u8>>; 2] = [None, None];
        loop {
            for (i, slot) in out.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                if let Some(pos) = find(&b.data[i], token) {
                    let mut taken: Vec<u8> = b.data[i].drain(..pos + token.len()).collect();
                    taken.truncate(pos);
                    *slot = Some(taken);
                } else if b.closed[i] {
                    *slot = Some(std::mem::take(&mut b.data[i]));
                }
            }
            if out.iter().all(Option::is_some) {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                for (i, slot) in out.iter_mut().enumerate() {
                    if slot.is_none() {
                        *slot = Some(std::mem::take(&mut b.data[i]));
                    }
                }
                break;
            }
            b = cv
                .wait_timeout(b, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        out.map(|o| o.unwrap_or_default())
    }

    /// Everything buffered so far (used when the worker is gone).
    pub fn take_all(&self, deadline: Instant) -> [Vec<u8>; 2] {
        // An impossible token: waits for both streams to close.
        self.take_until(b"\x1e\x00never\x00\x1e", deadline)
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn splits_at_the_token_and_keeps_the_rest() {
        let raw = RawOutput::default();
        raw.attach(0, &b"hello\x1eT\x1enext"[..]);
        raw.attach(1, &b"err\x1eT\x1e"[..]);
        let got = raw.take_until(b"\x1eT\x1e", Instant::now() + Duration::from_secs(5));
        assert_eq!(got[0], b"hello");
        assert_eq!(got[1], b"err");
        let rest = raw.take_all(Instant::now() + Duration::from_secs(5));
        assert_eq!(rest[0], b"next");
        assert!(rest[1].is_empty());
    }
}
