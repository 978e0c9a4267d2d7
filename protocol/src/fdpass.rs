//! Frames that carry file descriptors (SCM_RIGHTS) over a Unix stream
//! socket: how the supervisor hands a new worker's socket and output pipes
//! to the zygote that forks it.

use crate::frame::{FrameError, MAX_FRAME_BYTES};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Most descriptors one frame may carry.
pub const MAX_FDS: usize = 16;

fn cmsg_space() -> usize {
    // SAFETY: CMSG_SPACE is a pure size computation.
    unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// Writes `msg` as one frame on `sock`, with `fds` attached to its first
/// byte. The descriptors stay open on this side.
pub fn send_frame_with_fds<S: AsRawFd, T: Serialize>(
    sock: &S,
    msg: &T,
    fds: &[RawFd],
) -> Result<(), FrameError> {
    assert!(
        fds.len() <= MAX_FDS,
        "at most {MAX_FDS} descriptors per frame"
    );
    let payload = serde_json::to_vec(msg)?;
    if payload.len() > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(payload.len()));
    }
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    buf.extend_from_slice(&payload);
    let mut sent = 0;
    let mut first = true;
    while sent < buf.len() {
        let mut iov = libc::iovec {
            iov_base: buf[sent..].as_ptr() as *mut libc::c_void,
            iov_len: buf.len() - sent,
        };
        let mut control = vec![0u8; cmsg_space()];
        // SAFETY: msghdr points at our iovec and control buffer, both alive
        // for the sendmsg call; the cmsg header is written inside the
        // buffer sized by CMSG_SPACE for up to MAX_FDS descriptors.
        let n = unsafe {
            let mut hdr: libc::msghdr = std::mem::zeroed();
            hdr.msg_iov = &mut iov;
            hdr.msg_iovlen = 1;
            if first && !fds.is_empty() {
                let len = std::mem::size_of_val(fds);
                hdr.msg_control = control.as_mut_ptr().cast();
                hdr.msg_controllen = libc::CMSG_SPACE(len as u32) as usize;
                let cmsg = libc::CMSG_FIRSTHDR(&hdr);
                (*cmsg).cmsg_level = libc::SOL_SOCKET;
                (*cmsg).cmsg_type = libc::SCM_RIGHTS;
                (*cmsg).cmsg_len = libc::CMSG_LEN(len as u32) as usize;
                std::ptr::copy_nonoverlapping(
                    fds.as_ptr(),
                    libc::CMSG_DATA(cmsg).cast::<RawFd>(),
                    fds.len(),
                );
            }
            libc::sendmsg(sock.as_raw_fd(), &hdr, libc::MSG_NOSIGNAL)
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e.into());
        }
        first = false;
        sent += n as usize;
    }
    Ok(())
}

/// Reads one frame from `sock` with the descriptors attached to it.
/// Returns [`FrameError::Closed`] when the peer closed at a frame boundary.
pub fn recv_frame_with_fds<S: AsRawFd + Read, T: DeserializeOwned>(
    sock: &mut S,
) -> Result<(T, Vec<OwnedFd>), FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0usize;
    let mut fds = Vec::new();
    while got < 4 {
        let mut iov = libc::iovec {
            iov_base: len[got..].as_mut_ptr().cast(),
            iov_len: 4 - got,
        };
        let mut control = vec![0u8; cmsg_space()];
        // SAFETY: msghdr points at our iovec and control buffer, alive for
        // the call; received descriptors are read from cmsgs that the
        // kernel wrote inside the buffer and become owned by us at once.
        let n = unsafe {
            let mut hdr: libc::msghdr = std::mem::zeroed();
            hdr.msg_iov = &mut iov;
            hdr.msg_iovlen = 1;
            hdr.msg_control = control.as_mut_ptr().cast();
            hdr.msg_controllen = control.len();
            let n = libc::recvmsg(sock.as_raw_fd(), &mut hdr, libc::MSG_CMSG_CLOEXEC);
            if n > 0 {
                let mut cmsg = libc::CMSG_FIRSTHDR(&hdr);
                while !cmsg.is_null() {
                    if (*cmsg).cmsg_level == libc::SOL_SOCKET
                        && (*cmsg).cmsg_type == libc::SCM_RIGHTS
                    {
                        let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                        let count = ((*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize)
                            / std::mem::size_of::<RawFd>();
                        for i in 0..count {
                            fds.push(OwnedFd::from_raw_fd(*data.add(i)));
                        }
                    }
                    cmsg = libc::CMSG_NXTHDR(&hdr, cmsg);
                }
            }
            n
        };
        match n {
            0 if got == 0 => return Err(FrameError::Closed),
            0 => return Err(FrameError::Io(io::ErrorKind::UnexpectedEof.into())),
            n if n < 0 => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e.into());
                }
            }
            n => got += n as usize,
        }
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(len));
    }
    let mut payload = vec![0u8; len];
    sock.read_exact(&mut payload)?;
    Ok((serde_json::from_slice(&payload)?, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn descriptors_travel_with_the_frame() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let (mut pipe_r, pipe_w) = UnixStream::pair().unwrap();
        send_frame_with_fds(&a, &"hello", &[pipe_w.as_raw_fd()]).unwrap();
        send_frame_with_fds(&a, &"no fds", &[]).unwrap();
        let (msg, fds): (String, _) = recv_frame_with_fds(&mut b).unwrap();
        assert_eq!(msg, "hello");
        assert_eq!(fds.len(), 1);
        let mut w = UnixStream::from(fds.into_iter().next().unwrap());
        w.write_all(b"x").unwrap();
        let mut got = [0u8; 1];
        pipe_r.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"x");
        let (msg, fds): (String, _) = recv_frame_with_fds(&mut b).unwrap();
        assert_eq!(msg, "no fds");
        assert!(fds.is_empty());
        drop(a);
        assert!(matches!(
            recv_frame_with_fds::<_, String>(&mut b),
            Err(FrameError::Closed)
        ));
    }
}
