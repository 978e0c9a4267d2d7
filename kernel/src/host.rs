//! The kernel host: one process whose supervisor serves every kernel
//! started with the same flags, so a kernel starts, and restarts, in
//! milliseconds (a session from the host's zygote) rather than in the
//! time a new supervisor and its zygotes take.
//!
//! A front end starts `rvisor kernel --connection-file F` as always; that
//! process is the kernel's *stub*: it finds (or starts) the host for its
//! flags, listening on a Unix socket in the user's private [`host_dir`],
//! hands it the connection file, forwards SIGINT and SIGTERM, and exits
//! when the host says the kernel ended, with its status. The host binds
//! the kernel's five sockets itself and serves them with [`crate::serve`]
//! in a session of its own; a stub that goes away (killed, its front end
//! gone) stops its kernel. A host with no kernel for its idle time exits.
//!
//! The stub-host protocol is JSON lines: the stub sends
//! `{"connection": TEXT}` (the connection file), then `{"interrupt": true}`
//! or `{"term": true}` at any time; the host answers `{"ready": true}`
//! once the sockets are bound, and `{"exit": 0}` (or `{"exit": 1,
//! "error": ...}`) when the kernel has ended and its sockets are closed.
//! docs/jupyter.md, "The kernel host".

use crate::{serve, ConnectionInfo, Control, Input, InputRouter, Listeners};
use rvisor_server::service::{Service, LOCAL_TENANT};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Largest line either side sends (a connection file is a few hundred
/// bytes; its reader caps the file at 64 KiB).
const MAX_LINE_BYTES: u64 = 256 * 1024;

/// The directory of this user's kernel hosts: `$RVISOR_KERNEL_HOST_DIR`,
/// else `$XDG_RUNTIME_DIR/rvisor-kernels`, else `/tmp/rvisor-kernels-UID`.
/// Made with mode 0700; refused when another user owns it or others may
/// enter it (a host's socket takes kernels, and their keys, from whoever
/// can reach it).
pub fn host_dir() -> Result<PathBuf, String> {
    // SAFETY: geteuid(2) has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let dir = match std::env::var_os("RVISOR_KERNEL_HOST_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => match std::env::var_os("XDG_RUNTIME_DIR") {
            Some(d) if !d.is_empty() => PathBuf::from(d).join("rvisor-kernels"),
            _ => std::env::temp_dir().join(format!("rvisor-kernels-{uid}")),
        },
    };
    let bad = |why: String| format!("the kernel host directory {}: {why}", dir.display());
    if let Err(e) = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
    {
        return Err(bad(e.to_string()));
    }
    let meta = std::fs::symlink_metadata(&dir).map_err(|e| bad(e.to_string()))?;
    if !meta.is_dir() {
        return Err(bad("not a directory".into()));
    }
    if meta.uid() != uid {
        return Err(bad(format!(
            "owned by uid {}, not this user ({uid}); set RVISOR_KERNEL_HOST_DIR to a \
             directory of your own, or pass --in-process",
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| {
            bad(format!(
                "others may enter it and it cannot be made 0700: {e}"
            ))
        })?;
    }
    Ok(dir)
}

/// A host's key: what decides which kernels may share it (the program,
/// its flags, its directory and the environment its sessions see), as 24
/// hex digits of a SHA-256.
pub fn key<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> String {
    let mut h = Sha256::new();
    h.update(b"rvisor-kernel-host 1\0");
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The files of the host of one key in [`host_dir`].
#[derive(Debug, Clone)]
pub struct Paths {
    /// The host's socket.
    pub socket: PathBuf,
    /// Taken by the stub that starts a host (so two stubs start one).
    pub lock: PathBuf,
    /// The host's stderr.
    pub log: PathBuf,
}

impl Paths {
    /// The files of the host of `key` in `dir`.
    pub fn new(dir: &Path, key: &str) -> Self {
        Self {
            socket: dir.join(format!("{key}.sock")),
            lock: dir.join(format!("{key}.lock")),
            log: dir.join(format!("{key}.log")),
        }
    }
}

/// What a host answered a stub's connection file.
#[derive(Debug)]
pub enum Attach {
    /// The kernel's sockets are bound: it is serving.
    Ready(Attached),
    /// The host refused the kernel (a bad connection file, a port taken):
    /// what it said.
    Refused(String),
    /// No host answered (none is listening, or it was exiting): start one.
    NoHost,
}

/// A stub's kernel in a host.
#[derive(Debug)]
pub struct Attached {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

/// Hands the connection file `connection` to the host on `socket`, with
/// the ports already listening (the host's libzmq takes them over; the
/// caller may close its own copies once this returns).
pub fn attach(socket: &Path, connection: &str, listeners: &Listeners) -> Attach {
    let Ok(stream) = UnixStream::connect(socket) else {
        return Attach::NoHost;
    };
    let Ok(writer) = stream.try_clone() else {
        return Attach::NoHost;
    };
    let mut a = Attached {
        reader: BufReader::new(stream),
        writer,
    };
    let (places, fds): (Vec<usize>, Vec<_>) = listeners.raw().into_iter().unzip();
    if crate::listeners::send_fds(&a.writer, &fds).is_err()
        || send_line(
            &mut a.writer,
            &json!({"connection": connection, "listeners": places}),
        )
        .is_err()
    {
        return Attach::NoHost;
    }
    let first = loop {
        match read_line(&mut a.reader) {
            // The kernel's messages before it is ready, on this stub's stderr.
            Some(v) if v["stderr"].is_string() => {
                eprintln!("{}", v["stderr"].as_str().unwrap_or_default());
            }
            other => break other,
        }
    };
    match first {
        Some(v) if v["ready"] == true => Attach::Ready(a),
        Some(v) => Attach::Refused(
            v["error"]
                .as_str()
                .unwrap_or("the kernel host refused the kernel")
                .to_string(),
        ),
        None => Attach::NoHost,
    }
}

/// Whether a host listens on `socket`.
pub fn listening(socket: &Path) -> bool {
    UnixStream::connect(socket).is_ok()
}

impl Attached {
    /// What forwards the stub's signals to its kernel.
    pub fn remote(&self) -> std::io::Result<Remote> {
        Ok(Remote(Arc::new(Mutex::new(self.writer.try_clone()?))))
    }

    /// Waits for the kernel to end: its exit status, or why it ended
    /// without one (the host died).
    pub fn wait(mut self) -> Result<i32, String> {
        loop {
            match read_line(&mut self.reader) {
                Some(v) if v["stderr"].is_string() => {
                    eprintln!("{}", v["stderr"].as_str().unwrap_or_default());
                }
                Some(v) if v["exit"].is_i64() => {
                    if let Some(e) = v["error"].as_str() {
                        eprintln!("rvisor kernel: {e}");
                    }
                    return Ok(v["exit"].as_i64().unwrap_or(1) as i32);
                }
                Some(_) => continue,
                None => return Err("the kernel host ended without ending this kernel".into()),
            }
        }
    }
}

/// Sends a stub's interrupts and stops to its kernel.
#[derive(Debug, Clone)]
pub struct Remote(Arc<Mutex<UnixStream>>);

impl Remote {
    /// Interrupts the kernel's running cell.
    pub fn interrupt(&self) {
        self.send(json!({"interrupt": true}));
    }

    /// Stops the kernel (as SIGTERM stops a kernel of its own).
    pub fn term(&self) {
        self.send(json!({"term": true}));
    }

    fn send(&self, v: Value) {
        let mut w = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let _ = send_line(&mut w, &v);
    }
}

fn send_line(w: &mut UnixStream, v: &Value) -> std::io::Result<()> {
    let mut line = v.to_string();
    line.push('\n');
    w.write_all(line.as_bytes())
}

/// One JSON line, at most [`MAX_LINE_BYTES`]; `None` at the end of the
/// stream or on a line that is not JSON.
fn read_line(r: &mut BufReader<UnixStream>) -> Option<Value> {
    let mut line = String::new();
    match r.by_ref().take(MAX_LINE_BYTES).read_line(&mut line) {
        Ok(0) | Err(_) => None,
        Ok(_) => serde_json::from_str(&line).ok(),
    }
}

/// The host's count of kernels, for its idle exit.
#[derive(Debug)]
struct Load {
    kernels: usize,
    idle_since: Instant,
    exiting: bool,
}

/// A kernel host: serves the kernels stubs hand it on `listener` (bound
/// at `socket`) in sessions of `service`, until it has had no kernel for
/// `idle`; then removes its socket and returns. `inputs` is the router
/// [`crate::configure_host`] gave.
pub fn serve_host(
    listener: UnixListener,
    socket: &Path,
    service: Service,
    inputs: InputRouter,
    idle: Duration,
) {
    let bound_inode = std::fs::metadata(socket).map(|m| m.ino()).ok();
    let load = Arc::new((
        Mutex::new(Load {
            kernels: 0,
            idle_since: Instant::now(),
            exiting: false,
        }),
        Condvar::new(),
    ));
    let counter = Arc::new(AtomicU64::new(0));
    {
        let load = load.clone();
        let _ = std::thread::Builder::new()
            .name("rvisor-kernel-host".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { continue };
                    if !same_user(&stream) {
                        eprintln!("rvisor kernel host: refused a connection from another user");
                        continue;
                    }
                    {
                        let mut l = lock(&load.0);
                        if l.exiting {
                            continue; // the stub starts another host
                        }
                        l.kernels += 1;
                    }
                    let (service, inputs, load) = (service.clone(), inputs.clone(), load.clone());
                    let n = counter.fetch_add(1, Ordering::Relaxed) + 1;
                    let _ = std::thread::Builder::new()
                        .name(format!("rvisor-kernel-{n}"))
                        .spawn(move || {
                            one_kernel(stream, &service, &inputs, n);
                            let mut l = lock(&load.0);
                            l.kernels -= 1;
                            if l.kernels == 0 {
                                l.idle_since = Instant::now();
                            }
                            load.1.notify_all();
                        });
                }
            });
    }
    let (m, cv) = &*load;
    let mut l = lock(m);
    loop {
        if l.kernels == 0 && l.idle_since.elapsed() >= idle {
            l.exiting = true;
            break;
        }
        let wait = if l.kernels == 0 {
            idle.saturating_sub(l.idle_since.elapsed())
        } else {
            Duration::from_secs(3600)
        };
        l = cv
            .wait_timeout(l, wait.max(Duration::from_millis(10)))
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    drop(l);
    // Only our own socket: a host started after this one decided to exit
    // may have bound the path anew.
    if std::fs::metadata(socket).map(|m| m.ino()).ok() == bound_inode {
        let _ = std::fs::remove_file(socket);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether the peer of `s` runs as this process's user (the directory's
/// mode already keeps others out; this is the second lock).
fn same_user(s: &UnixStream) -> bool {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of a ucred and its
    // length, which SO_PEERCRED fills; the descriptor is `s`'s, open for
    // the call.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    // SAFETY: geteuid(2) has no preconditions.
    rc == 0 && cred.uid == unsafe { libc::geteuid() }
}

/// Serves the kernel of one stub's connection, in a new session.
fn one_kernel(stream: UnixStream, service: &Service, inputs: &InputRouter, n: u64) {
    let Ok(writer) = stream.try_clone() else {
        return;
    };
    let writer = Arc::new(Mutex::new(writer));
    let say = |v: Value| {
        let _ = send_line(&mut lock(&writer), &v);
    };
    // The ports the stub bound come first, then its connection file.
    let fds = match crate::listeners::recv_fds(&stream) {
        Ok(Some(fds)) => fds,
        Ok(None) => return, // a stub looking whether a host listens
        Err(e) => {
            say(json!({"exit": 1, "error": format!("failed to receive the kernel's ports: {e}")}));
            return;
        }
    };
    let mut reader = BufReader::new(stream);
    let Some(first) = read_line(&mut reader) else {
        return;
    };
    // Each descriptor with its socket's place; a count that does not
    // match gives none (they close, and libzmq binds the ports itself).
    let places: Vec<usize> = first["listeners"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as usize)
                .collect()
        })
        .unwrap_or_default();
    let listeners = if places.len() == fds.len() {
        Listeners::from_parts(places.into_iter().zip(fds).collect())
    } else {
        Listeners::default()
    };
    let conn = match first["connection"]
        .as_str()
        .ok_or_else(|| "the first line has no connection file".to_string())
        .and_then(ConnectionInfo::parse)
    {
        Ok(c) => c,
        Err(e) => {
            say(json!({"exit": 1, "error": format!("the connection file: {e}")}));
            return;
        }
    };
    let session_id = match service.named_session(LOCAL_TENANT, &format!("jupyter-{n}"), true) {
        Ok(Some(id)) => id,
        Ok(None) => {
            say(json!({"exit": 1, "error": "the kernel's session was not made"}));
            return;
        }
        Err(e) => {
            say(json!({"exit": 1, "error": e.message}));
            return;
        }
    };
    // The kernel's own messages go to its stub's standard error (the
    // front end's), not to the host's log.
    {
        let writer = writer.clone();
        crate::log::Log::to(move |line| {
            let _ = send_line(&mut lock(&writer), &json!({"stderr": line}));
        })
        .enter();
    }
    let input = Input::default();
    inputs.insert(&session_id, input.clone());
    let control = Control::new();
    {
        let control = control.clone();
        let _ = std::thread::Builder::new()
            .name(format!("rvisor-kernel-{n}-stub"))
            .spawn(move || loop {
                match read_line(&mut reader) {
                    Some(v) if v["interrupt"] == true => control.interrupt(),
                    Some(v) if v["term"] == true => control.stop(),
                    Some(_) => {}
                    // The stub is gone (killed, or its front end is):
                    // nothing will read this kernel's end.
                    None => {
                        control.stop();
                        return;
                    }
                }
            });
    }
    let served = serve(
        service.clone(),
        &conn,
        input,
        listeners,
        &session_id,
        &control,
        || say(json!({"ready": true})),
    );
    inputs.remove(&session_id);
    match served {
        Ok(()) => say(json!({"exit": 0})),
        Err(e) => say(json!({"exit": 1, "error": e.to_string()})),
    }
    let _ = lock(&writer).shutdown(std::net::Shutdown::Both);
}
