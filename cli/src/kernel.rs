//! `rvisor kernel`: the Jupyter kernel (`--connection-file FILE`, as a
//! front end starts it) and `rvisor kernel install` (its kernelspec).

use super::SessionArgs;
use anyhow::{bail, Context, Result};
use rvisor_kernel::host;
use rvisor_kernel::kernelspec::{self, Target};
use rvisor_server::service::{Service, ServiceConfig};
use rvisor_server::tables::TableConfig;
use std::io::{BufRead, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

/// Arguments of `rvisor kernel`.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct KernelArgs {
    #[command(subcommand)]
    action: Option<KernelAction>,
    /// The connection file the Jupyter front end wrote.
    #[arg(long, value_name = "FILE")]
    connection_file: Option<PathBuf>,
    /// Run this kernel's supervisor in this process, as its own, rather
    /// than in the kernel host that kernels with the same flags share:
    /// every start and restart then waits for a new supervisor and its
    /// zygote (docs/jupyter.md, "The kernel host").
    #[arg(long)]
    in_process: bool,
    /// Seconds the kernel host lingers with no kernel before it exits (0:
    /// it exits with its last kernel).
    #[arg(long, default_value_t = 600.0, value_name = "SECS", value_parser = crate::serve::non_negative_secs)]
    host_idle_secs: f64,
    /// Serve as the kernel host on this Unix socket (a stub starts it so).
    #[arg(long, hide = true, value_name = "SOCKET")]
    host_socket: Option<PathBuf>,
    #[command(flatten)]
    opts: SessionArgs,
}

#[derive(clap::Subcommand, Debug)]
enum KernelAction {
    /// Write a kernelspec so `jupyter kernelspec list` (and every Jupyter
    /// front end) finds this kernel; arguments after `--` are added to
    /// the kernel's command (session flags: `-- --timeout 120`).
    Install {
        /// Into the user's Jupyter directory (~/.local/share/jupyter).
        #[arg(long, conflicts_with = "prefix")]
        user: bool,
        /// Into PREFIX/share/jupyter (a virtualenv's prefix, say).
        #[arg(long, value_name = "DIR")]
        prefix: Option<PathBuf>,
        /// The kernel's name (its directory).
        #[arg(long, default_value = "rvisor")]
        name: String,
        /// The name front ends show.
        #[arg(long, default_value = "R (rvisor)")]
        display_name: String,
        /// Flags of `rvisor kernel` the spec passes (after `--`).
        #[arg(last = true)]
        extra: Vec<String>,
    },
}

/// Runs `rvisor kernel`.
pub(crate) fn main(args: KernelArgs) -> Result<ExitCode> {
    match args.action {
        Some(KernelAction::Install {
            user,
            prefix,
            name,
            display_name,
            extra,
        }) => install(user, prefix, &name, &display_name, &extra),
        None => {
            if let Some(socket) = &args.host_socket {
                return host(socket, &args);
            }
            let Some(file) = &args.connection_file else {
                bail!(
                    "pass --connection-file FILE (Jupyter does, from the kernelspec that \
                     `rvisor kernel install --user` writes)"
                );
            };
            if args.in_process {
                serve(file, &args.opts, None)
            } else {
                via_host(file, &args)
            }
        }
    }
}

fn install(
    user: bool,
    prefix: Option<PathBuf>,
    name: &str,
    display_name: &str,
    extra: &[String],
) -> Result<ExitCode> {
    let target = match (user, prefix) {
        (true, _) => Target::User,
        (false, Some(p)) => Target::Prefix(p),
        (false, None) => Target::System,
    };
    let program = std::env::current_exe()
        .context("failed to find this program's own path for the kernelspec")?;
    let dir = kernelspec::install(&target, name, display_name, &program, extra)?;
    crate::out::line(format_args!(
        "rvisor: installed the kernelspec {name:?} in {}",
        dir.display()
    ))?;
    Ok(ExitCode::SUCCESS)
}

/// A supervisor and service for kernels of these flags; `configure` sets
/// the kernels' session defaults (and gives what the kernel needs of
/// them). The tables' directory is the caller's to remove.
fn kernel_service<T>(
    opts: &SessionArgs,
    configure: impl FnOnce(&mut rvisor::SessionOptions) -> T,
) -> Result<(Service, rvisor::Supervisor, PathBuf, T)> {
    let mut cfg = opts.supervisor_config();
    cfg.defaults = opts.options()?;
    let given = configure(&mut cfg.defaults);
    cfg.checkpoints = opts.checkpoints()?;
    // The per-call timeout range stretched to the session's timeout, as for
    // `session --jsonl` (a notebook may run long fits).
    let t = &mut cfg.rules.timeout_seconds;
    t.default = cfg.defaults.timeout.as_secs().max(1);
    t.max = t.max.max(cfg.defaults.timeout.as_secs_f64().ceil() as u64);
    let sup = rvisor::Supervisor::new(cfg)?;
    let dir = std::env::temp_dir().join(format!(
        "rvisor-kernel-tables-{}",
        rvisor::ids::random_hex(6)
    ));
    let service = Service::new(
        sup.clone(),
        ServiceConfig {
            tables: TableConfig {
                dir: dir.clone(),
                ..TableConfig::default()
            },
            ..ServiceConfig::default()
        },
    )
    .context("failed to start the service")?;
    Ok((service, sup, dir, given))
}

/// `--in-process`: this process is the kernel, with a supervisor of its
/// own, on `listeners` when the stub bound them (else bound here first,
/// before the supervisor starts).
fn serve(
    file: &Path,
    opts: &SessionArgs,
    listeners: Option<rvisor_kernel::Listeners>,
) -> Result<ExitCode> {
    let conn = rvisor_kernel::ConnectionInfo::read(file)?;
    let listeners = match listeners {
        Some(l) => l,
        None => rvisor_kernel::Listeners::bind(&conn)?,
    };
    let (service, sup, dir, input) = kernel_service(opts, rvisor_kernel::configure)?;
    let served = rvisor_kernel::run(service.clone(), &conn, input, listeners);
    service.close_all();
    sup.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    served?;
    Ok(ExitCode::SUCCESS)
}

/// The kernel host (`--host-socket`): serves the kernels that stubs of
/// the same flags hand it, until it has had none for `--host-idle-secs`.
fn host(socket: &Path, args: &KernelArgs) -> Result<ExitCode> {
    let (service, sup, dir, inputs) = kernel_service(&args.opts, rvisor_kernel::configure_host)?;
    sup.cleanup_on_signals()?;
    let listener = std::os::unix::net::UnixListener::bind(socket)
        .with_context(|| format!("failed to listen on {}", socket.display()))?;
    // The stub that started this host waits for this line on the pipe
    // that is stdout; then stdout is /dev/null, so that the pipe closes and
    // nothing later written there can fail.
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{LISTENING}")?;
        out.flush()?;
    }
    let null = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
    // SAFETY: dup2 onto descriptor 1 replaces this process's stdout with
    // /dev/null, an open descriptor owned by `null` for the call; nothing
    // holds a borrowed handle to the old descriptor's pipe across it (the
    // lock above is released).
    if unsafe { libc::dup2(null.as_raw_fd(), 1) } < 0 {
        return Err(std::io::Error::last_os_error()).context("failed to close the start-up pipe");
    }
    eprintln!(
        "rvisor kernel host {}: listening on {}",
        std::process::id(),
        socket.display()
    );
    host::serve_host(
        listener,
        socket,
        service.clone(),
        inputs,
        Duration::from_secs_f64(args.host_idle_secs),
    );
    eprintln!("rvisor kernel host {}: idle, exiting", std::process::id());
    service.close_all();
    sup.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ExitCode::SUCCESS)
}

/// What a host writes on stdout once it listens.
const LISTENING: &str = "rvisor-kernel-host listening";

/// How many times a stub starts a host that then does not take its kernel
/// (one that was exiting as the stub came).
const HOST_TRIES: usize = 3;

/// The default: this process is the kernel's stub; its kernel runs in the
/// host of its flags, started if none is running.
fn via_host(file: &Path, args: &KernelArgs) -> Result<ExitCode> {
    // Read (and checked) here, so a bad file is this process's error.
    let conn = rvisor_kernel::ConnectionInfo::read(file)?;
    // The ports listen from now on: a front end that connects before the
    // kernel host has bound them waits in their backlog rather than
    // retrying after libzmq's reconnect interval (docs/jupyter.md, "The
    // kernel host").
    let listeners = rvisor_kernel::Listeners::bind(&conn)?;
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("failed to read {}", file.display()))?;
    // Where no host can be had (no private directory, no process to
    // start), the kernel runs in this process, as with --in-process.
    let fallback = |why: String, listeners| {
        eprintln!("rvisor kernel: {why}; running this kernel in its own process (--in-process)");
        serve(file, &args.opts, Some(listeners))
    };
    let dir = match host::host_dir() {
        Ok(d) => d,
        Err(why) => return fallback(why, listeners),
    };
    let paths = host::Paths::new(&dir, &host_key(args)?);
    for _ in 0..HOST_TRIES {
        match host::attach(&paths.socket, &text, &listeners) {
            host::Attach::Ready(a) => {
                // The host has its own copies of the ports now.
                drop(listeners);
                return stub(a, &paths);
            }
            host::Attach::Refused(why) => bail!("{why}"),
            host::Attach::NoHost => {
                if let Err(e) = start_host(&paths) {
                    return fallback(format!("{e:#}"), listeners);
                }
            }
        }
    }
    bail!(
        "no kernel host took this kernel after {HOST_TRIES} starts; its log is {} \
         (or pass --in-process)",
        paths.log.display()
    )
}

/// The stub's part: signals forwarded, its front end watched, until the
/// host says the kernel ended.
fn stub(a: host::Attached, paths: &host::Paths) -> Result<ExitCode> {
    let remote = a.remote().context("failed to talk to the kernel host")?;
    let (on_int, on_term, on_gone) = (remote.clone(), remote.clone(), remote);
    if let Err(e) =
        rvisor_kernel::signals::watch(move || on_int.interrupt(), move || on_term.term())
    {
        eprintln!("rvisor kernel: SIGINT will not interrupt cells ({e}); interrupt_request on control still does");
    }
    rvisor_kernel::watch_parent(move || on_gone.term());
    match a.wait() {
        Ok(0) => Ok(ExitCode::SUCCESS),
        Ok(n) => Ok(ExitCode::from(u8::try_from(n).unwrap_or(1))),
        Err(e) => bail!("{e}; its log is {}", paths.log.display()),
    }
}

/// This command's arguments without its connection file: what a host of
/// the same flags is started with.
fn host_args() -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    let mut args = std::env::args_os().skip(1);
    while let Some(a) = args.next() {
        if a == "--connection-file" {
            args.next();
        } else if !a.to_string_lossy().starts_with("--connection-file=") {
            out.push(a);
        }
    }
    out
}

/// The host key of this kernel: the program (path, size and time), its
/// flags, its directory (flags may name relative paths) and the variables
/// its sessions or its supervisor read (`R_*`, `RVISOR_*`, the `--env`
/// names; all but the front end's `JPY_*` with `--inherit-env`).
fn host_key(args: &KernelArgs) -> Result<String> {
    let exe = std::env::current_exe().context("failed to find this program's own path")?;
    let meta = std::fs::metadata(&exe)?;
    let stamp = format!(
        "{}:{}:{:?}",
        exe.display(),
        meta.len(),
        meta.modified().ok()
    );
    let mut parts: Vec<Vec<u8>> = vec![stamp.into_bytes()];
    for a in host_args() {
        parts.push(a.into_encoded_bytes());
    }
    parts.push(
        std::env::current_dir()?
            .into_os_string()
            .into_encoded_bytes(),
    );
    let names = args.opts.env_names();
    let mut env: Vec<(String, String)> = std::env::vars_os()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.to_string_lossy().into_owned(),
            )
        })
        .filter(|(k, _)| match names {
            None => !k.starts_with("JPY_"),
            Some(n) => k.starts_with("R_") || k.starts_with("RVISOR_") || n.contains(k),
        })
        .collect();
    env.sort();
    for (k, v) in env {
        parts.push(format!("{k}={v}").into_bytes());
    }
    Ok(host::key(parts.iter().map(Vec::as_slice)))
}

/// Starts the host of `paths` unless another stub has meanwhile; returns
/// once it listens.
fn start_host(paths: &host::Paths) -> Result<()> {
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&paths.lock)
        .with_context(|| format!("failed to open {}", paths.lock.display()))?;
    // SAFETY: flock(2) on the descriptor `lock` owns, open for the call;
    // the lock goes with the descriptor when `lock` is dropped.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("failed to lock {}", paths.lock.display()));
    }
    if host::listening(&paths.socket) {
        return Ok(()); // another stub started it while this one waited
    }
    // A host that died leaves its socket behind.
    let _ = std::fs::remove_file(&paths.socket);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&paths.log)
        .with_context(|| format!("failed to open {}", paths.log.display()))?;
    if log.metadata().map(|m| m.len()).unwrap_or(0) > MAX_LOG_BYTES {
        let _ = log.set_len(0);
    }
    let exe = std::env::current_exe().context("failed to find this program's own path")?;
    let mut child = Command::new(exe)
        .args(host_args())
        .arg("--host-socket")
        .arg(&paths.socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .env_remove("JPY_PARENT_PID")
        // Its own process group: a front end's signal to the kernel's
        // group (an interrupt, a kill) reaches the stub, not the host.
        .process_group(0)
        .spawn()
        .context("failed to start the kernel host")?;
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        if readable_within(&out, HOST_START_WAIT) {
            let _ = std::io::BufReader::new(out).read_line(&mut line);
        } else {
            // A host that neither starts nor fails: it is ended (its whole
            // process group, R workers too), and the kernel runs in its own
            // process instead.
            // SAFETY: kill(2) on the process group of our own child (its
            // pid is its group's id: `process_group(0)`), not waited for
            // yet, so the id is not reused.
            unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
            let _ = child.wait();
            bail!(
                "the kernel host did not say it was listening within {} s; it was stopped. \
                 Its log is {}",
                HOST_START_WAIT.as_secs(),
                paths.log.display()
            );
        }
    }
    if line.trim_end() != LISTENING {
        let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
        let tail = std::fs::read_to_string(&paths.log).unwrap_or_default();
        let tail: Vec<&str> = tail.lines().rev().take(5).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "the kernel host did not start ({status}): {}; its log is {}",
            tail.join(" | "),
            paths.log.display()
        );
    }
    // The host lives on; it is not this process's to wait for.
    drop(child);
    Ok(())
}

/// How long a stub waits for a host it started to say it is listening
/// (R's start and the first worker take a second or two; Jupyter front
/// ends wait 60 s for a kernel).
const HOST_START_WAIT: std::time::Duration = std::time::Duration::from_secs(45);

/// Whether `f` has something to read (or its writer closed it) within
/// `wait`.
fn readable_within(f: &impl AsRawFd, wait: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut pfd = libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one pollfd that lives for the call.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if n > 0 {
            return true;
        }
        if n == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return n < 0; // an error: let the read say what it is
        }
    }
}

/// A host's log is emptied when a stub finds it larger than this.
const MAX_LOG_BYTES: u64 = 1 << 20;
