//! The kernel's five TCP ports, listening from the moment its process
//! starts. A front end connects as soon as it has launched the kernel;
//! a port nobody listens on yet refuses it, and libzmq tries again only
//! after its reconnect interval (100 ms by default in jupyter_client), so
//! a kernel that binds later than the front end connects starts 100 ms
//! late. The stub binds the ports first thing, hands the listening
//! sockets to its kernel host with the connection file (`SCM_RIGHTS`),
//! and libzmq takes them over (`ZMQ_USE_FD`) instead of binding its own:
//! connections that came meanwhile wait in the backlog and are accepted.

use crate::connection::ConnectionInfo;
use crate::error::KernelError;
use std::net::{IpAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};

/// The sockets in the order they are passed: shell, control, stdin, iopub,
/// hb.
pub const NAMES: [&str; 5] = ["shell", "control", "stdin", "iopub", "hb"];

/// Listening sockets for some of the five ports (none for an `ipc`
/// connection file, or one whose address is not an IP: libzmq binds those
/// itself).
#[derive(Debug, Default)]
pub struct Listeners {
    fds: [Option<OwnedFd>; 5],
}

/// The ports of `conn` in [`NAMES`]' order.
fn ports(conn: &ConnectionInfo) -> [u16; 5] {
    [
        conn.shell_port,
        conn.control_port,
        conn.stdin_port,
        conn.iopub_port,
        conn.hb_port,
    ]
}

impl Listeners {
    /// Binds and listens on the five TCP ports of `conn` (a `*` or empty
    /// address is every interface, as for libzmq). A port that is taken
    /// is an error naming it; an `ipc` transport, an address that is not
    /// an IP, or a port 0 gives none (libzmq binds them later).
    pub fn bind(conn: &ConnectionInfo) -> Result<Self, KernelError> {
        let mut out = Self::default();
        if conn.transport != "tcp" {
            return Ok(out);
        }
        let ip: IpAddr = match conn.ip.as_str() {
            "*" | "" => IpAddr::from([0, 0, 0, 0]),
            ip => match ip.trim_matches(['[', ']']).parse() {
                Ok(ip) => ip,
                Err(_) => return Ok(out),
            },
        };
        for (i, port) in ports(conn).into_iter().enumerate() {
            if port == 0 {
                continue;
            }
            let fail = |e: std::io::Error| KernelError::Socket {
                socket: NAMES[i],
                endpoint: conn.endpoint(port),
                why: e.to_string(),
            };
            // std sets SO_REUSEADDR on Unix before bind, as libzmq does, so
            // a restarted kernel can bind the ports again at once.
            let l = TcpListener::bind((ip, port)).map_err(fail)?;
            l.set_nonblocking(true).map_err(fail)?;
            out.fds[i] = Some(OwnedFd::from(l));
        }
        Ok(out)
    }

    /// The listening sockets there are, to pass on, with their places.
    pub fn raw(&self) -> Vec<(usize, RawFd)> {
        self.fds
            .iter()
            .enumerate()
            .filter_map(|(i, f)| f.as_ref().map(|f| (i, f.as_raw_fd())))
            .collect()
    }

    /// Listeners received with their places (as [`Listeners::raw`] gave
    /// them); places out of range are closed.
    pub fn from_parts(parts: Vec<(usize, OwnedFd)>) -> Self {
        let mut out = Self::default();
        for (i, fd) in parts {
            if let Some(slot) = out.fds.get_mut(i) {
                *slot = Some(fd);
            }
        }
        out
    }

    /// The listener of socket `name` ([`NAMES`]), if there is one.
    pub(crate) fn take(&mut self, name: &str) -> Option<OwnedFd> {
        let i = NAMES.iter().position(|n| *n == name)?;
        self.fds[i].take()
    }
}

/// Has libzmq socket `s` take listener `fd` for its next bind, instead of
/// making and binding one. On success libzmq owns the descriptor (it
/// closes it with the socket).
pub(crate) fn adopt(s: &mut zmq::Socket, fd: OwnedFd) -> Result<(), zmq::Error> {
    let raw: libc::c_int = fd.as_raw_fd();
    // SAFETY: `s.as_mut_ptr()` is the live libzmq socket `s` owns;
    // ZMQ_USE_FD takes an int, read from `raw` (valid for the call) with
    // its size. libzmq only records the number here; the descriptor stays
    // open (owned by `fd`) until it is handed over below.
    let rc = unsafe {
        zmq_sys::zmq_setsockopt(
            s.as_mut_ptr(),
            zmq_sys::ZMQ_USE_FD as libc::c_int,
            (&raw as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>(),
        )
    };
    if rc != 0 {
        // SAFETY: zmq_errno(3) reads this thread's libzmq error number.
        return Err(zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() }));
    }
    // The socket's bind uses it and its close closes it: libzmq's now.
    let _ = fd.into_raw_fd();
    Ok(())
}

/// Sends one byte on `stream` with `fds` attached (`SCM_RIGHTS`), or
/// with nothing attached when `fds` is empty.
pub fn send_fds(stream: &std::os::unix::net::UnixStream, fds: &[RawFd]) -> std::io::Result<()> {
    let byte = [b'F'];
    let mut iov = libc::iovec {
        iov_base: byte.as_ptr() as *mut libc::c_void,
        iov_len: 1,
    };
    // Room for 5 descriptors, aligned as cmsghdr needs.
    let mut space = [0u64; 8];
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let data_len = std::mem::size_of_val(fds);
    if !fds.is_empty() {
        // SAFETY: CMSG_SPACE only computes a size.
        let needed = unsafe { libc::CMSG_SPACE(data_len as u32) } as usize;
        if needed > std::mem::size_of_val(&space) {
            return Err(std::io::Error::other("too many descriptors to pass"));
        }
        msg.msg_control = space.as_mut_ptr().cast();
        msg.msg_controllen = needed;
        // SAFETY: msg_control points at `space`, large enough for one
        // header with `data_len` bytes (checked above), so CMSG_FIRSTHDR
        // is that header and CMSG_DATA its data, both inside `space`; the
        // copy writes `data_len` bytes there from `fds`.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(data_len as u32) as usize;
            std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(c), data_len);
        }
    }
    // SAFETY: `msg` points at `iov` (the byte) and, when set, at `space`,
    // all alive for the call; the descriptor is `stream`'s.
    let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Receives the byte [`send_fds`] sends and the descriptors that came
/// with it (close-on-exec); `Ok(None)` when the peer closed first.
pub fn recv_fds(stream: &std::os::unix::net::UnixStream) -> std::io::Result<Option<Vec<OwnedFd>>> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut space = [0u64; 8];
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&space);
    // SAFETY: `msg` points at `iov` (one writable byte) and at `space`
    // (writable, its size in msg_controllen), alive for the call; the
    // descriptor is `stream`'s.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg_control with msg_controllen bytes of
    // well-formed headers; CMSG_FIRSTHDR/CMSG_NXTHDR walk them and stay
    // inside it; an SCM_RIGHTS header's data holds (cmsg_len - CMSG_LEN(0))
    // / size_of::<c_int>() descriptors, now ours, each taken once (read
    // unaligned: CMSG_DATA need not be aligned for c_int).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let len = (*c).cmsg_len - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                for k in 0..len / std::mem::size_of::<libc::c_int>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(k).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if n == 0 {
        return Ok(None);
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(std::io::Error::other(
            "more descriptors came than a kernel has sockets",
        ));
    }
    Ok(Some(fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn conn(ports: [u16; 5]) -> ConnectionInfo {
        ConnectionInfo::parse(
            &serde_json::json!({
                "transport": "tcp", "ip": "127.0.0.1", "key": "k",
                "shell_port": ports[0], "control_port": ports[1], "stdin_port": ports[2],
                "iopub_port": ports[3], "hb_port": ports[4],
            })
            .to_string(),
        )
        .unwrap()
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// A connection made before anyone accepts waits in the backlog, and
    /// the listener passed over a Unix socket accepts it on the other side.
    #[test]
    fn a_listener_passed_over_a_unix_socket_accepts_an_early_connection() {
        let ports = [free_port(), free_port(), free_port(), free_port(), 0];
        let l = Listeners::bind(&conn(ports)).unwrap();
        assert_eq!(l.raw().len(), 4, "port 0 is left to libzmq");
        let mut early = std::net::TcpStream::connect(("127.0.0.1", ports[0])).unwrap();
        early.write_all(b"hi").unwrap();
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let raw: Vec<(usize, RawFd)> = l.raw();
        send_fds(&a, &raw.iter().map(|(_, f)| *f).collect::<Vec<_>>()).unwrap();
        drop(l); // the sender's copies close; the passed ones live on
        let got = recv_fds(&b).unwrap().unwrap();
        assert_eq!(got.len(), 4);
        let mut got =
            Listeners::from_parts(raw.iter().map(|(i, _)| *i).zip(got).collect::<Vec<_>>());
        let shell = TcpListener::from(got.take("shell").unwrap());
        shell.set_nonblocking(false).unwrap();
        let (mut s, _) = shell.accept().unwrap();
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hi");
        assert!(got.take("hb").is_none());
    }

    #[test]
    fn a_taken_port_is_an_error_naming_the_socket() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let e = Listeners::bind(&conn([
            free_port(),
            port,
            free_port(),
            free_port(),
            free_port(),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("control socket") && e.contains(&port.to_string()),
            "{e}"
        );
    }

    #[test]
    fn without_tcp_there_is_nothing_to_bind() {
        let mut c = conn([1, 2, 3, 4, 5]);
        c.transport = "ipc".into();
        assert!(Listeners::bind(&c).unwrap().raw().is_empty());
        let peer_closed = std::os::unix::net::UnixStream::pair().unwrap();
        drop(peer_closed.0);
        assert!(recv_fds(&peer_closed.1).unwrap().is_none());
    }
}
