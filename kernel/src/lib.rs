//! A Jupyter kernel over the rvisor service: the messaging protocol (5.3)
//! on libzmq, each cell a call of one session of the [`Service`], with the
//! same timeouts, limits, confinement and policy as every other surface.
//!
//! Threads: the shell loop (the caller's: execute, complete, inspect,
//! is_complete, history, comm_info, kernel_info), control (kernel_info,
//! interrupt, shutdown: answered while a cell runs), heartbeat, and the
//! signal watcher (SIGINT interrupts the running cell). docs/jupyter.md.

pub mod connection;
pub mod displays;
pub mod error;
mod execute;
pub mod history;
pub mod host;
mod introspect;
pub mod kernelspec;
pub mod listeners;
pub mod log;
pub mod signals;
pub mod sockets;
pub mod stdin;
pub mod wire;

pub use connection::ConnectionInfo;
pub use error::KernelError;
pub use listeners::Listeners;
pub use stdin::{Input, InputRouter};

use rvisor::CancelToken;
use rvisor_server::service::{Service, LOCAL_TENANT};
use serde_json::{json, Value};
use sockets::{Iopub, POLL_MS};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use wire::{Message, Signer, WireError};

/// The name of the kernel's session in the service.
const SESSION_NAME: &str = "jupyter";

/// What shell and control share.
#[derive(Debug, Clone)]
struct Common {
    iopub: Iopub,
    signer: Signer,
    control: Control,
    info: Value,
    cell: Arc<Mutex<Cell>>,
}

/// The cell being executed, as the interrupt sees it.
#[derive(Debug, Default)]
pub(crate) struct Cell {
    /// An execute is in progress (from its busy to its idle).
    pub(crate) active: bool,
    /// Its call, once queued.
    pub(crate) cancel: Option<CancelToken>,
    /// An interrupt came before the call was queued: it is cancelled as
    /// soon as it is.
    pub(crate) interrupted: bool,
}

/// A lock, poisoned or not (what these guard holds no invariant a panic
/// breaks).
fn lock_any<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The cell state, poisoned or not (it holds no invariant a panic breaks).
pub(crate) fn lock(cell: &Mutex<Cell>) -> std::sync::MutexGuard<'_, Cell> {
    cell.lock().unwrap_or_else(|p| p.into_inner())
}

impl Common {
    /// Interrupts the cell being executed (see [`Control::interrupt`]).
    fn interrupt(&self) {
        CellRef(&self.cell).interrupt_cell();
    }
}

/// A kernel's stop flag and its running cell, for what stops or
/// interrupts it from outside its sockets: SIGINT and SIGTERM in a kernel
/// of its own ([`run`]), the stub's connection in a kernel host
/// ([`host`]).
#[derive(Debug, Clone, Default)]
pub struct Control {
    stop: Arc<AtomicBool>,
    cell: Arc<Mutex<Cell>>,
    /// Readable once the kernel is stopped, so that its loops, which poll
    /// it beside their sockets, end at once rather than at their next
    /// [`POLL_MS`] (a restart waits for the ports to be free).
    wake: Option<Arc<Wake>>,
}

/// A socket pair, written once, on stop, and never read.
#[derive(Debug)]
struct Wake {
    reader: std::os::unix::net::UnixStream,
    writer: Mutex<std::os::unix::net::UnixStream>,
}

impl Control {
    /// A kernel not yet stopped, with no cell running.
    pub fn new() -> Self {
        let wake = match std::os::unix::net::UnixStream::pair() {
            Ok((reader, writer)) => Some(Arc::new(Wake {
                reader,
                writer: Mutex::new(writer),
            })),
            // Without it, loops see the stop within POLL_MS.
            Err(_) => None,
        };
        Self {
            wake,
            ..Self::default()
        }
    }

    /// What the kernel's loops poll beside their socket.
    pub(crate) fn wake_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.wake.as_ref().map(|w| w.reader.as_raw_fd())
    }

    /// Interrupts the running cell (its session and state stay).
    pub fn interrupt(&self) {
        CellRef(&self.cell).interrupt_cell();
    }

    /// Stops the kernel: its loops end within [`sockets::POLL_MS`] (a
    /// running cell is interrupted first).
    pub fn stop(&self) {
        self.interrupt();
        if !self.stop.swap(true, Ordering::SeqCst) {
            if let Some(w) = &self.wake {
                use std::io::Write;
                let _ = lock_any(&w.writer).write_all(b"s");
            }
        }
    }

    /// Whether the kernel was told to stop.
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

/// The running cell, as an interrupt reaches it.
struct CellRef<'a>(&'a Mutex<Cell>);

impl CellRef<'_> {
    /// Interrupts the cell being executed, wherever it is (queued, running,
    /// or not yet queued); the session and its state stay.
    fn interrupt_cell(&self) {
        let mut c = lock(self.0);
        match &c.cancel {
            Some(t) => t.cancel(),
            None if c.active => c.interrupted = true,
            None => {}
        }
    }
}

/// The shell loop's state.
pub(crate) struct Shell {
    service: Service,
    tenant: String,
    session_id: String,
    iopub: Iopub,
    signer: Signer,
    sock: zmq::Socket,
    cell: Arc<Mutex<Cell>>,
    execution_count: u64,
    history: history::History,
    input: Input,
}

impl Shell {
    /// Sends the reply `msg_type` to `parent` on the shell socket.
    fn reply(&self, parent: &Message, msg_type: &str, content: Value) {
        sockets::send(
            &self.sock,
            "shell",
            &parent.reply(msg_type, content),
            &self.signer,
        );
    }
}

/// The `kernel_info_reply` content.
fn kernel_info(r_version: &str) -> Value {
    json!({
        "status": "ok",
        "protocol_version": wire::PROTOCOL_VERSION,
        "implementation": "rvisor",
        "implementation_version": env!("CARGO_PKG_VERSION"),
        "language_info": {
            "name": "R",
            "version": r_version,
            "mimetype": "text/x-r-source",
            "file_extension": ".r",
            "pygments_lexer": "r",
            "codemirror_mode": "r",
        },
        "banner": format!(
            "R {r_version} in rvisor {} (a confined session; interrupts keep its state)",
            env!("CARGO_PKG_VERSION")
        ),
        "help_links": [{"text": "rvisor's Jupyter kernel", "url": "https://github.com/rvisor/rvisor/blob/main/docs/jupyter.md"}],
        "debugger": false,
    })
}

/// Decodes a message; a bad one is reported on stderr and dropped
/// (a wrong signature never reaches R).
pub(crate) fn decode(frames: Vec<Vec<u8>>, signer: &Signer, socket: &str) -> Option<Message> {
    match Message::decode(frames, signer) {
        Ok(m) => Some(m),
        Err(WireError::BadSignature) => {
            log::say(&format!("rvisor kernel: refused a message on {socket} whose signature does not match the connection key"));
            None
        }
        Err(e) => {
            log::say(&format!(
                "rvisor kernel: dropped a message on {socket}: {e}"
            ));
            None
        }
    }
}

/// What the kernel's session needs beyond the defaults, set on the
/// supervisor's session defaults before the service is made: visible
/// values as displays (the cell's `execute_result`), and the input tool
/// (`input_request`), whose other end is the returned [`Input`], for
/// [`run`].
pub fn configure(defaults: &mut rvisor::SessionOptions) -> Input {
    defaults.display.values = Some(true);
    let input = Input::default();
    defaults.tools.push(input.tool());
    input
}

/// [`configure`] for a kernel host ([`host`]): its kernels' sessions
/// share the defaults, so they share one input tool, which asks the front
/// end of the kernel whose session calls it.
pub fn configure_host(defaults: &mut rvisor::SessionOptions) -> InputRouter {
    defaults.display.values = Some(true);
    let router = InputRouter::default();
    defaults.tools.push(router.tool());
    router
}

/// Serves the kernel on the sockets of `conn` until a `shutdown_request`
/// or SIGTERM, in a session of its own named [`SESSION_NAME`]; the session
/// is closed on the way out. `input` is the one [`configure`] gave (a
/// default one: R's input functions are refused). SIGINT interrupts the
/// running cell. The whole process is this kernel's: see [`host`] for
/// kernels that share one supervisor. `listeners` are the ports bound
/// when the process started ([`Listeners::bind`]; libzmq binds the rest).
pub fn run(
    service: Service,
    conn: &ConnectionInfo,
    input: Input,
    listeners: Listeners,
) -> Result<(), KernelError> {
    let session_id = service
        .named_session(LOCAL_TENANT, SESSION_NAME, true)
        .map_err(|e| KernelError::Session(e.message))?
        .ok_or_else(|| KernelError::Session("the session was not made".into()))?;
    let control = Control::new();
    {
        let on_int = control.clone();
        let on_term = control.clone();
        if let Err(e) = signals::watch(move || on_int.interrupt(), move || on_term.stop()) {
            eprintln!("rvisor kernel: SIGINT will not interrupt cells ({e}); interrupt_request on control still does");
        }
    }
    let on_gone = control.clone();
    watch_parent(move || on_gone.stop());
    serve(
        service,
        conn,
        input,
        listeners,
        &session_id,
        &control,
        || {},
    )
}

/// Serves one kernel on the sockets of `conn` in the service's session
/// `session_id` (of [`LOCAL_TENANT`]) until a `shutdown_request` or
/// `control` stops it; `ready` is called once the five sockets are bound
/// (on `listeners` where there are some). The session is closed, and
/// every socket closed (its port free again), before this returns.
pub fn serve(
    service: Service,
    conn: &ConnectionInfo,
    input: Input,
    mut listeners: Listeners,
    session_id: &str,
    control: &Control,
    ready: impl FnOnce(),
) -> Result<(), KernelError> {
    let signer = Signer::new(&conn.key);
    let ctx = zmq::Context::new();
    let served = (|| {
        let mut bind = |kind, name: &'static str, port| {
            sockets::bind(&ctx, kind, name, conn, port, listeners.take(name))
        };
        let shell = bind(zmq::ROUTER, "shell", conn.shell_port)?;
        let control_sock = bind(zmq::ROUTER, "control", conn.control_port)?;
        // R's readline() asks through it (stdin.rs).
        input.attach(bind(zmq::ROUTER, "stdin", conn.stdin_port)?, signer.clone());
        let hb = bind(zmq::REP, "hb", conn.hb_port)?;
        let iopub = Iopub::new(
            sockets::bind_iopub(&ctx, conn, listeners.take("iopub"))?,
            signer.clone(),
        );
        ready();
        serve_bound(
            &service,
            session_id,
            &input,
            control,
            signer,
            shell,
            control_sock,
            iopub,
            hb,
        )
    })();
    input.detach();
    let _ = service.close(LOCAL_TENANT, session_id);
    // Every socket is dropped by now: terminating the context waits for
    // libzmq to close them (at most their linger), so the ports are free
    // for a restarted kernel when this returns.
    drop(ctx);
    served
}

/// [`serve`] once its sockets are bound.
#[allow(clippy::too_many_arguments)]
fn serve_bound(
    service: &Service,
    session_id: &str,
    input: &Input,
    control: &Control,
    signer: Signer,
    shell: zmq::Socket,
    control_sock: zmq::Socket,
    iopub: Iopub,
    hb: zmq::Socket,
) -> Result<(), KernelError> {
    // Known without waiting for R to start (read from its installation
    // when the zygote is not up yet), so that a first kernel_info_reply,
    // which front ends wait for, and their quiet time after it (200 ms in
    // jupyter_client's wait_for_ready) overlap R's start-up.
    let pool = service.supervisor().pool();
    let r_version = pool
        .r_version_now()
        .or_else(|| pool.r_version(Duration::from_secs(30)))
        .unwrap_or_default();
    let common = Common {
        iopub: iopub.clone(),
        signer: signer.clone(),
        control: control.clone(),
        info: kernel_info(&r_version),
        cell: control.cell.clone(),
    };
    // The kernel's threads write its messages where this thread does
    // (log.rs: to the stub, in a kernel host).
    let log = log::Log::current();
    let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
        let log = log.clone();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                log.enter();
                f()
            })
            .map_err(|e| KernelError::Session(e.to_string()))
    };
    let hb_thread = {
        let control = control.clone();
        spawn(
            "rvisor-kernel-hb",
            Box::new(move || sockets::heartbeat(hb, &control)),
        )?
    };
    let welcome_thread = {
        let control = control.clone();
        let iopub = iopub.clone();
        spawn(
            "rvisor-kernel-iopub",
            Box::new(move || iopub.welcome_loop(&control)),
        )?
    };
    let control_thread = {
        let common = common.clone();
        spawn(
            "rvisor-kernel-control",
            Box::new(move || control_loop(control_sock, common)),
        )?
    };
    let mut sh = Shell {
        service: service.clone(),
        tenant: LOCAL_TENANT.to_string(),
        session_id: session_id.to_string(),
        iopub,
        signer,
        sock: shell,
        cell: common.cell.clone(),
        execution_count: 0,
        history: history::History::default(),
        input: input.clone(),
    };
    // A front end may wait for a first status before it sends anything.
    sh.iopub.send(
        &Message {
            ids: vec![],
            header: json!({}),
            parent_header: json!({}),
            metadata: json!({}),
            content: json!({}),
            buffers: vec![],
        },
        "status",
        json!({"execution_state": "starting"}),
    );
    let served = shell_loop(&mut sh, &common);
    control.stop();
    let _ = control_thread.join();
    let _ = hb_thread.join();
    let _ = welcome_thread.join();
    served
}

/// A kernel started by a front end (jupyter_client sets `JPY_PARENT_PID`,
/// as ipykernel reads it) stops when that front end is gone without
/// shutting it down: its parent process changes. Calls `on_gone` (from a
/// thread of its own) when it does; does nothing when this process was
/// not started so.
pub fn watch_parent(on_gone: impl FnOnce() + Send + 'static) {
    let Some(parent) = std::env::var("JPY_PARENT_PID")
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return;
    };
    // SAFETY: getppid(2) has no preconditions.
    let now = unsafe { libc::getppid() };
    if now != parent {
        return; // started through a wrapper: nothing reliable to watch
    }
    let _ = std::thread::Builder::new()
        .name("rvisor-kernel-parent".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_secs(1));
            // SAFETY: getppid(2) has no preconditions.
            if unsafe { libc::getppid() } != parent {
                eprintln!(
                    "rvisor kernel: the front end that started this kernel is gone; stopping"
                );
                on_gone();
                return;
            }
        });
}

fn shell_loop(sh: &mut Shell, common: &Common) -> Result<(), KernelError> {
    while !common.control.stopped() {
        let Some(frames) = sockets::recv(&sh.sock, "shell", POLL_MS, common.control.wake_fd())?
        else {
            continue;
        };
        let Some(msg) = decode(frames, &sh.signer, "shell") else {
            continue;
        };
        if let execute::Ended::ErrorStop(waiting) = execute_or_answer(sh, common, &msg) {
            abort(sh, common, waiting);
        }
    }
    Ok(())
}

/// The shell requests waiting now (bounded: at most a queue's worth).
pub(crate) fn waiting(sh: &Shell) -> Vec<Message> {
    let mut out = Vec::new();
    while out.len() < MAX_ABORTED {
        match sockets::recv(&sh.sock, "shell", 0, None) {
            Ok(Some(frames)) => out.extend(decode(frames, &sh.signer, "shell")),
            Ok(None) => break,
            Err(e) => {
                log::say(&format!("rvisor kernel: {e}"));
                break;
            }
        }
    }
    out
}

/// Most requests taken at once after a failed cell.
const MAX_ABORTED: usize = 1024;

/// After a failed cell with `stop_on_error`: the execute requests that were
/// waiting are answered `aborted` without running; other requests are
/// served.
fn abort(sh: &mut Shell, common: &Common, waiting: Vec<Message>) {
    for msg in waiting {
        if msg.msg_type() == "execute_request" {
            sh.iopub.status(&msg, "busy");
            sh.iopub.status(&msg, "idle");
            sh.reply(
                &msg,
                "execute_reply",
                json!({"status": "aborted", "execution_count": sh.execution_count}),
            );
        } else {
            execute_or_answer(sh, common, &msg);
        }
    }
}

fn execute_or_answer(sh: &mut Shell, common: &Common, msg: &Message) -> execute::Ended {
    let t = msg.msg_type();
    if t == "execute_request" {
        return execute::execute(sh, msg);
    }
    let Some(reply_type) = t.strip_suffix("_request").map(|b| format!("{b}_reply")) else {
        comm(sh, msg);
        return execute::Ended::Ok;
    };
    sh.iopub.status(msg, "busy");
    let content = match t {
        "kernel_info_request" => Some(common.info.clone()),
        "complete_request" => Some(introspect::complete(sh, &msg.content)),
        "inspect_request" => Some(introspect::inspect(sh, &msg.content)),
        "is_complete_request" => Some(introspect::is_complete(sh, &msg.content)),
        "history_request" => Some(sh.history.reply(&msg.content)),
        "comm_info_request" => Some(json!({"status": "ok", "comms": {}})),
        "shutdown_request" => Some(shutdown(common, msg)),
        "interrupt_request" => {
            common.interrupt();
            Some(json!({"status": "ok"}))
        }
        _ => None,
    };
    match content {
        Some(c) => sh.reply(msg, &reply_type, c),
        None => log::say(&format!("rvisor kernel: ignored a {t} (not supported)")),
    }
    sh.iopub.status(msg, "idle");
    execute::Ended::Ok
}

/// Comm messages: no comm targets exist, so a `comm_open` is closed
/// at once (the protocol's answer to an unknown target).
fn comm(sh: &Shell, msg: &Message) {
    if msg.msg_type() == "comm_open" {
        sh.iopub.send(
            msg,
            "comm_close",
            json!({"comm_id": msg.content["comm_id"], "data": {}}),
        );
    }
}

/// `shutdown_request`: the kernel stops after its reply (a restart is the
/// front end's: it starts a new kernel, whose session is a fresh worker
/// from a new zygote).
fn shutdown(common: &Common, msg: &Message) -> Value {
    common.control.stop();
    let restart = msg.content["restart"].as_bool().unwrap_or(false);
    let content = json!({"status": "ok", "restart": restart});
    common.iopub.send(msg, "shutdown_reply", content.clone());
    content
}

fn control_loop(sock: zmq::Socket, common: Common) {
    while !common.control.stopped() {
        let frames = match sockets::recv(&sock, "control", POLL_MS, common.control.wake_fd()) {
            Ok(Some(f)) => f,
            Ok(None) => continue,
            Err(e) => {
                log::say(&format!("rvisor kernel: {e}"));
                return;
            }
        };
        let Some(msg) = decode(frames, &common.signer, "control") else {
            continue;
        };
        let t = msg.msg_type();
        common.iopub.status(&msg, "busy");
        let reply = match t {
            "kernel_info_request" => Some(("kernel_info_reply", common.info.clone())),
            "interrupt_request" => {
                common.interrupt();
                Some(("interrupt_reply", json!({"status": "ok"})))
            }
            "shutdown_request" => Some(("shutdown_reply", shutdown(&common, &msg))),
            _ => None,
        };
        match reply {
            Some((rt, c)) => sockets::send(&sock, "control", &msg.reply(rt, c), &common.signer),
            None => log::say(&format!(
                "rvisor kernel: ignored a {t} on control (not supported)"
            )),
        }
        common.iopub.status(&msg, "idle");
    }
}
