//! Connection discipline for `rvisor serve`: the HTTP accept loop (hyper
//! under our own control instead of `axum::serve`), the connection caps and
//! timeouts both listeners keep, graceful shutdown with a deadline, and the
//! lock that allows one server per data directory.
//!
//! Why not `axum::serve`: it has no header-read or idle timeout, no cap on
//! connections, and its graceful shutdown waits for every connection,
//! idle ones included, without a deadline. A half-sent request line could
//! hold a descriptor forever and keep SIGTERM from stopping the server.
//!
//! An HTTP connection is in one of three phases:
//! - `Head`: waiting for a request's headers, from accept or from the first
//!   byte of the next request on a kept-alive connection. The headers must
//!   be complete within `header_timeout`, or the connection is dropped.
//! - `Busy`: a request is being handled or its response written. No timeout
//!   here: call deadlines and the upload idle timeout bound that time.
//! - `Idle`: kept alive between requests; closed after `idle_timeout`.
//!
//! At shutdown, connections that are not `Busy` close at once; busy ones
//! finish their request (keep-alive off) for at most `shutdown_grace`,
//! after which every remaining connection is closed.

use axum::Router;
use std::collections::HashMap;
use std::io::{Read, Seek, Write};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{watch, Notify};

/// Caps and timeouts of the listeners (`ServeConfig.connections`; `rvisor
/// serve` flags in brackets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// HTTP: time from accept (or from the first byte of a later request on
    /// the same connection) until the request's headers are complete; then
    /// the connection is dropped (10 s; `--header-timeout-secs`).
    pub header_timeout: Duration,
    /// HTTP: how long a kept-alive connection may wait for its next request
    /// (60 s; `--idle-timeout-secs`).
    pub idle_timeout: Duration,
    /// HTTP: how long a request body may take to arrive, JSON bodies in
    /// all and uploads between two pieces (30 s; `--body-timeout-secs`).
    pub body_timeout: Duration,
    /// nng: how long a connection may go without receiving a byte while no
    /// request of it is in flight (300 s; `--nng-idle-timeout-secs`).
    pub nng_idle_timeout: Duration,
    /// Open connections per listener; more are accepted and closed at once
    /// (1024; `--max-connections`).
    pub max_connections: usize,
    /// Open connections per peer IP address per listener (TCP; IPC peers
    /// count only against `max_connections`) (64;
    /// `--max-connections-per-ip`).
    pub max_connections_per_ip: usize,
    /// At SIGINT/SIGTERM: how long requests in flight may take to finish
    /// before every remaining connection is closed (30 s;
    /// `--shutdown-grace-secs`).
    pub shutdown_grace: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(30),
            nng_idle_timeout: Duration::from_secs(300),
            max_connections: 1024,
            max_connections_per_ip: 64,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

// ---------------------------------------------------------------------------
// Connection caps

/// Counts a listener's open connections, in total and per peer address,
/// and refuses those over the caps.
#[derive(Debug)]
pub(crate) struct Gate {
    /// `http` or `nng`, for the log.
    surface: &'static str,
    max_total: usize,
    max_per_ip: usize,
    state: Mutex<GateState>,
}

#[derive(Debug, Default)]
struct GateState {
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
    /// Refusals since the listener started.
    refused: u64,
    /// Refusals not yet in a log line.
    unlogged: u64,
    last_log: Option<Instant>,
}

/// At most one refusal line per this interval: a flood of connections
/// must not become a flood of log lines.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// An admitted connection; dropping it frees its place.
#[derive(Debug)]
pub(crate) struct Permit {
    gate: Arc<Gate>,
    ip: Option<IpAddr>,
}

impl Gate {
    pub(crate) fn new(surface: &'static str, limits: &ConnectionLimits) -> Arc<Gate> {
        Arc::new(Gate {
            surface,
            max_total: limits.max_connections,
            max_per_ip: limits.max_connections_per_ip,
            state: Mutex::new(GateState::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        // The state is counters only: a panic elsewhere leaves them usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place for a connection from `ip` (`None`: a Unix socket peer), or
    /// why not (already logged, rate-limited).
    pub(crate) fn admit(self: &Arc<Self>, ip: Option<IpAddr>) -> Result<Permit, String> {
        let mut st = self.lock();
        let per_ip = ip.map_or(0, |ip| st.per_ip.get(&ip).copied().unwrap_or(0));
        let refusal = if st.total >= self.max_total {
            Some(format!(
                "{} connections are open, the most this server takes (--max-connections)",
                st.total
            ))
        } else if ip.is_some() && per_ip >= self.max_per_ip {
            Some(format!(
                "{per_ip} connections from this address are open, the most one address may have \
                 (--max-connections-per-ip)"
            ))
        } else {
            None
        };
        if let Some(why) = refusal {
            st.refused += 1;
            st.unlogged += 1;
            let now = Instant::now();
            if st
                .last_log
                .is_none_or(|t| now.duration_since(t) >= REFUSAL_LOG_INTERVAL)
            {
                let peer = ip.map_or_else(|| "a local peer".to_string(), |ip| ip.to_string());
                tracing::warn!(
                    target: "rvisor::listen",
                    surface = self.surface,
                    peer,
                    refused = st.unlogged,
                    refused_total = st.refused,
                    "connections refused: {why}"
                );
                st.unlogged = 0;
                st.last_log = Some(now);
            }
            return Err(why);
        }
        st.total += 1;
        if let Some(ip) = ip {
            *st.per_ip.entry(ip).or_insert(0) += 1;
        }
        Ok(Permit {
            gate: self.clone(),
            ip,
        })
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut st = self.gate.lock();
        st.total = st.total.saturating_sub(1);
        if let Some(ip) = self.ip {
            if let Some(n) = st.per_ip.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    st.per_ip.remove(&ip);
                }
            }
        }
    }
}

/// Waits until `shutdown` turns true (or its sender is gone, which also
/// means stop).
pub(crate) async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// Waits for the tasks of `set` to end, for at most `grace`; then aborts
/// those left (closing their connections) and says how many there were.
pub(crate) async fn drain(set: &mut tokio::task::JoinSet<()>, grace: Duration) -> usize {
    let all = async { while set.join_next().await.is_some() {} };
    if tokio::time::timeout(grace, all).await.is_ok() {
        return 0;
    }
    let left = set.len();
    set.abort_all();
    while set.join_next().await.is_some() {}
    left
}

// ---------------------------------------------------------------------------
// HTTP

#[derive(Debug, Clone, Copy)]
enum Phase {
    /// Waiting for a request's headers since then.
    Head(Instant),
    /// This many requests are being handled or answered.
    Busy(usize),
    /// Kept alive, no request, since then.
    Idle(Instant),
}

/// The phase of one HTTP connection, shared by its reader, its requests
/// and its watchdog.
#[derive(Debug)]
struct Watch {
    phase: Mutex<Phase>,
    changed: Notify,
}

impl Watch {
    fn set(&self, f: impl FnOnce(Phase) -> Option<Phase>) {
        let mut p = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(next) = f(*p) {
            *p = next;
            drop(p);
            self.changed.notify_waiters();
        }
    }

    fn phase(&self) -> Phase {
        *self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes arrived: on an idle connection they start the next request's
    /// header timeout.
    fn read_some(&self) {
        self.set(|p| match p {
            Phase::Idle(_) => Some(Phase::Head(Instant::now())),
            _ => None,
        });
    }

    fn begin(self: &Arc<Self>) -> Busy {
        self.set(|p| match p {
            Phase::Busy(n) => Some(Phase::Busy(n + 1)),
            _ => Some(Phase::Busy(1)),
        });
        Busy(self.clone())
    }

    /// Resolves with the name of the timeout when the connection has been
    /// waiting for headers, or idle, for too long.
    async fn expired(&self, limits: &ConnectionLimits) -> &'static str {
        loop {
            // Registered before the phase is read, so no change is missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let due = match self.phase() {
                Phase::Head(t) => Some((t + limits.header_timeout, "header timeout")),
                Phase::Idle(t) => Some((t + limits.idle_timeout, "idle timeout")),
                Phase::Busy(_) => None,
            };
            match due {
                Some((at, why)) => {
                    if Instant::now() >= at {
                        return why;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep_until(at.into()) => {}
                        _ = &mut changed => {}
                    }
                }
                None => changed.await,
            }
        }
    }
}

/// A request being handled; its end (the response body written or
/// dropped) makes the connection idle again.
#[derive(Debug)]
struct Busy(Arc<Watch>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.set(|p| match p {
            Phase::Busy(n) if n > 1 => Some(Phase::Busy(n - 1)),
            _ => Some(Phase::Idle(Instant::now())),
        });
    }
}

/// A stream that tells its [`Watch`] when bytes arrive.
struct Watched<S> {
    inner: S,
    watch: Arc<Watch>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.watch.read_some();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A response body that keeps its request [`Busy`] until it is written.
struct Tracked {
    inner: axum::body::Body,
    _busy: Busy,
}

impl http_body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// What an HTTP client over the caps gets before the connection closes.
fn refusal_response(why: &str) -> Vec<u8> {
    let body = serde_json::json!({"error": {
        "code": "busy",
        "message": format!("connection refused: {why}; close idle connections or retry later"),
    }})
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serves `app` on `listener` under `limits` until `shutdown` turns true;
/// then stops accepting at once, closes connections that have no request
/// in flight, lets the others finish for at most `limits.shutdown_grace`,
/// closes whatever is left and returns.
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ConnectionLimits,
    mut shutdown: watch::Receiver<bool>,
) {
    let limits = Arc::new(limits);
    let gate = Gate::new("http", &limits);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped(&mut shutdown) => break,
        };
        match accepted {
            Ok((stream, peer)) => match gate.admit(Some(peer.ip())) {
                Ok(permit) => {
                    let _ = stream.set_nodelay(true);
                    connections.spawn(http_connection(
                        stream,
                        app.clone(),
                        limits.clone(),
                        shutdown.clone(),
                        permit,
                    ));
                }
                Err(why) => {
                    // The send buffer of a new connection is empty: this
                    // small write does not block. Then it closes.
                    let _ = stream.try_write(&refusal_response(&why));
                }
            },
            Err(e) => accept_failed("http", &e).await,
        }
        // Forget connections that ended.
        while connections.try_join_next().is_some() {}
    }
    // Stop accepting at once: new connections are refused by the kernel.
    drop(listener);
    let left = drain(&mut connections, limits.shutdown_grace).await;
    if left > 0 {
        tracing::warn!(
            target: "rvisor::http",
            connections = left,
            grace_secs = limits.shutdown_grace.as_secs_f64(),
            "requests still running after the shutdown grace period: their connections were closed"
        );
    }
}

/// An accept error (out of descriptors, mostly): logged, and a short pause
/// so a persistent error does not spin.
pub(crate) async fn accept_failed(surface: &'static str, e: &std::io::Error) {
    tracing::warn!(target: "rvisor::listen", surface, error = %e, "accept failed");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

async fn http_connection(
    stream: tokio::net::TcpStream,
    app: Router,
    limits: Arc<ConnectionLimits>,
    mut shutdown: watch::Receiver<bool>,
    _permit: Permit,
) {
    let watch = Arc::new(Watch {
        phase: Mutex::new(Phase::Head(Instant::now())),
        changed: Notify::new(),
    });
    let io = hyper_util::rt::TokioIo::new(Watched {
        inner: stream,
        watch: watch.clone(),
    });
    let requests = watch.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        // Made when the headers are complete: from here on the request is
        // the handlers' (and the upload timeout's) to bound.
        let busy = requests.begin();
        let app = app.clone();
        async move {
            use tower::ServiceExt as _;
            let res = match app.oneshot(req).await {
                Ok(res) => res,
                Err(never) => match never {},
            };
            Ok::<_, std::convert::Infallible>(res.map(|inner| Tracked { inner, _busy: busy }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    // The header timeout is ours (hyper's would also cut idle keep-alive
    // connections at the same time): off in hyper.
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(None)
        .keep_alive(true);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut stopping = false;
    let end = loop {
        tokio::select! {
            r = conn.as_mut() => break r.err().map(|e| e.to_string()),
            why = watch.expired(&limits) => break Some(why.to_string()),
            _ = stopped(&mut shutdown), if !stopping => {
                stopping = true;
                if !matches!(watch.phase(), Phase::Busy(_)) {
                    break Some("shutdown".to_string());
                }
                // Finish the request in flight, then close (keep-alive off).
                conn.as_mut().graceful_shutdown();
            }
        }
    };
    if let Some(why) = end {
        tracing::debug!(target: "rvisor::http", reason = why, "connection closed");
    }
}

// ---------------------------------------------------------------------------
// One server per data directory

/// The name of the lock file in the data directory.
pub const LOCK_FILE: &str = "rvisor-serve.lock";

/// An exclusive lock on a data directory, held while it lives (the kernel
/// releases it when the process ends, however it ends).
#[derive(Debug)]
pub struct DataDirLock {
    _file: std::fs::File,
    path: PathBuf,
}

impl DataDirLock {
    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Takes the data directory `dir` (creating it) for this process: an
/// exclusive `flock` on `dir/rvisor-serve.lock`, which then holds our pid.
/// Another live holder is an error naming the directory and its pid: two
/// servers on one directory would overwrite each other's table index.
pub fn lock_data_dir(dir: &Path) -> std::io::Result<DataDirLock> {
    let context = |what: &str, e: std::io::Error| {
        std::io::Error::new(e.kind(), format!("{what} {}: {e}", dir.display()))
    };
    std::fs::create_dir_all(dir).map_err(|e| context("cannot create the data directory", e))?;
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| context("cannot open the lock file in the data directory", e))?;
    use std::os::fd::AsRawFd as _;
    // SAFETY: flock only takes a descriptor and flags; the descriptor
    // belongs to `file`, which is open for the whole call.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(context("cannot lock the data directory", e));
        }
        let mut text = String::new();
        let _ = file.read_to_string(&mut text);
        let pid = match text.trim() {
            "" => "pid unknown".to_string(),
            p => format!("pid {p}"),
        };
        return Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            format!(
                "another rvisor serve ({pid}) is using the data directory {}: stop it, or give \
                 this server a data directory of its own with --data-dir",
                dir.display()
            ),
        ));
    }
    let write_pid = |file: &mut std::fs::File| -> std::io::Result<()> {
        file.set_len(0)?;
        file.rewind()?;
        writeln!(file, "{}", std::process::id())?;
        file.flush()
    };
    write_pid(&mut file).map_err(|e| context("cannot write the lock file in", e))?;
    Ok(DataDirLock { _file: file, path })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(total: usize, per_ip: usize) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: total,
            max_connections_per_ip: per_ip,
            ..Default::default()
        }
    }

    #[test]
    fn the_gate_caps_per_address_and_in_total_and_frees_places() {
        let gate = Gate::new("test", &limits(3, 2));
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let b: IpAddr = "127.0.0.2".parse().unwrap();
        let a1 = gate.admit(Some(a)).unwrap();
        let _a2 = gate.admit(Some(a)).unwrap();
        let e = gate.admit(Some(a)).unwrap_err();
        assert!(e.contains("--max-connections-per-ip"), "{e}");
        let _b1 = gate.admit(Some(b)).unwrap();
        let e = gate.admit(None).unwrap_err();
        assert!(e.contains("--max-connections"), "{e}");
        drop(a1);
        let _a3 = gate.admit(Some(a)).unwrap();
        assert_eq!(gate.lock().refused, 2);
        assert_eq!(gate.lock().total, 3);
    }

    #[test]
    fn unix_peers_count_only_in_the_total() {
        let gate = Gate::new("test", &limits(3, 1));
        let _p: Vec<_> = (0..3).map(|_| gate.admit(None).unwrap()).collect();
        assert!(gate.admit(None).is_err());
    }

    #[test]
    fn a_data_directory_takes_one_lock() {
        let dir = std::env::temp_dir().join(format!("rvisor-lock-{}", rvisor::ids::random_hex(6)));
        let held = lock_data_dir(&dir).unwrap();
        let pid = std::fs::read_to_string(held.path()).unwrap();
        assert_eq!(pid.trim(), std::process::id().to_string());
        // flock locks belong to open files: a second open in this process
        // is refused as another server's would be.
        let e = lock_data_dir(&dir).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(&dir.display().to_string()), "{msg}");
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        drop(held);
        let again = lock_data_dir(&dir).unwrap();
        drop(again);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn the_watchdog_times_out_heads_and_idle_connections_but_not_requests() {
        let limits = ConnectionLimits {
            header_timeout: Duration::from_millis(50),
            idle_timeout: Duration::from_millis(80),
            ..Default::default()
        };
        let watch = Arc::new(Watch {
            phase: Mutex::new(Phase::Head(Instant::now())),
            changed: Notify::new(),
        });
        assert_eq!(watch.expired(&limits).await, "header timeout");
        let busy = watch.begin();
        let waited = tokio::time::timeout(Duration::from_millis(200), watch.expired(&limits));
        assert!(waited.await.is_err(), "a busy connection has no timeout");
        drop(busy);
        assert_eq!(watch.expired(&limits).await, "idle timeout");
        watch.read_some();
        assert!(matches!(watch.phase(), Phase::Head(_)));
    }
}
