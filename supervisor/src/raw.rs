//! Output of a process read by background threads until it closes: used for
//! the zygote's stderr, so a zygote that fails to start can say why. (A
//! worker's fds 1 and 2 are read by its link, see worker/io.rs.)

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

    /// Waits (until `deadline`) for both streams to close and returns
    /// everything they gave; streams still open give what they had.
    pub fn take_all(&self, deadline: Instant) -> [Vec<u8>; 2] {
        let (lock, cv) = &*self.inner;
        let mut b = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let now = Instant::now();
            if b.closed.iter().all(|c| *c) || now >= deadline {
                return [
                    std::mem::take(&mut b.data[0]),
                    std::mem::take(&mut b.data[1]),
                ];
            }
            b = cv
                .wait_timeout(b, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn collects_both_streams_until_they_close() {
        let raw = RawOutput::default();
        raw.attach(0, &b"out"[..]);
        raw.attach(1, &b"err"[..]);
        let got = raw.take_all(Instant::now() + Duration::from_secs(5));
        assert_eq!(got[0], b"out");
        assert_eq!(got[1], b"err");
    }
}
