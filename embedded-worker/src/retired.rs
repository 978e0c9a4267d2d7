//! A retired base zygote: once the warm zygote serves, the base zygote
//! gives up R (`ToZygote::Retire`). Its heap was shared page for page with
//! the warm zygote forked from it; kept, every page the warm zygote wrote
//! was held twice, and a page still shared could not go into the warm
//! zygote's huge pages without being copied (huge.rs). The base zygote
//! re-executes its own binary, which keeps its process, its children (the
//! warm zygote and the workers it forked before, which die with it by
//! their parent-death signal) and its control socket, and drops R's heap.
//! As a retired zygote it reaps and reports its children as before and
//! refuses forks. The supervisor starts a new base zygote when the warm
//! one has to be made again.

use crate::control::{chld_pipe, reap, refuse_fork, serve_control};
use rvisor_protocol::{write_frame, FromZygote, ToZygote, ENV_ZYGOTE_FD, ENV_ZYGOTE_RETIRED};
use std::collections::HashSet;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;

/// What a retired zygote answers a fork request with.
const REFUSAL: &str = "this zygote retired (its warm zygote forks): ask the warm zygote";

/// The value of [`ENV_ZYGOTE_RETIRED`]: the control socket, then the
/// confined workers' pids.
fn spec(ctl: RawFd, confined: &HashSet<libc::pid_t>) -> String {
    let pids: Vec<String> = confined.iter().map(|p| p.to_string()).collect();
    format!("{ctl};{}", pids.join(","))
}

/// The control socket and confined workers' pids from
/// [`ENV_ZYGOTE_RETIRED`]'s value.
fn parse(spec: &str) -> Option<(RawFd, HashSet<libc::pid_t>)> {
    let (fd, pids) = spec.split_once(';')?;
    let fd = fd.parse().ok().filter(|fd| *fd >= 0)?;
    let pids = pids
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|p| p.parse().ok())
        .collect::<Option<HashSet<_>>>()?;
    Some((fd, pids))
}

/// Re-executes this (base) zygote as a retired one. Returns only when it
/// could not, with why; the zygote then serves on as it was.
pub fn retire(ctl: RawFd, confined: &HashSet<libc::pid_t>) -> String {
    // The binary by its path (the kernel's link, which a process under
    // valgrind sees as its own program's, not valgrind's).
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return format!("could not find its own binary: {e}"),
    };
    // SAFETY: fcntl on the control socket this zygote owns: it is kept
    // open across the exec below (everything else of the zygote's is
    // close-on-exec or harmless to keep).
    if unsafe { libc::fcntl(ctl, libc::F_SETFD, 0) } != 0 {
        return format!(
            "could not keep the control socket: {}",
            std::io::Error::last_os_error()
        );
    }
    let err = std::process::Command::new(exe)
        .arg0("rvisor-worker")
        .env_remove(ENV_ZYGOTE_FD)
        .env_remove(rvisor_protocol::timing::ENV_TIMING)
        .env(ENV_ZYGOTE_RETIRED, spec(ctl, confined))
        .exec();
    // SAFETY: as above; the exec failed, so the socket is ours still.
    unsafe { libc::fcntl(ctl, libc::F_SETFD, libc::FD_CLOEXEC) };
    format!("could not re-execute itself: {err}")
}

/// Serves as a retired zygote (`spec`: [`ENV_ZYGOTE_RETIRED`]'s value):
/// says so, then reaps and reports its children and refuses forks until
/// the supervisor closes the socket.
pub fn serve(spec: &str) -> Result<(), String> {
    let (fd, mut confined) =
        parse(spec).ok_or_else(|| format!("{ENV_ZYGOTE_RETIRED} is not valid: {spec:?}"))?;
    // SAFETY: the zygote this process was kept this descriptor across its
    // exec for this; nothing else in the process owns it.
    let mut ctl = unsafe {
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        UnixStream::from_raw_fd(fd)
    };
    let pipe = chld_pipe()?;
    write_frame(&mut ctl, &FromZygote::Retired).map_err(|e| e.to_string())?;
    // Children that ended while the process re-executed (no SIGCHLD
    // handler then) are reaped at once.
    reap(&mut ctl, &mut confined)?;
    serve_control(ctl, pipe, &mut confined, |ctl, req, _fds, _| match req {
        ToZygote::Fork(r) => refuse_fork(ctl, r.worker_id, REFUSAL.into()),
        ToZygote::Warm(r) => refuse_fork(ctl, r.worker_id, REFUSAL.into()),
        ToZygote::Retire | ToZygote::Compact => Ok(()),
        ToZygote::Hello { .. } => Err("unexpected second hello".into()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_and_confined_pids_survive_the_exec() {
        let pids: HashSet<libc::pid_t> = [12, 345].into_iter().collect();
        let (fd, back) = parse(&spec(7, &pids)).expect("parses");
        assert_eq!((fd, back), (7, pids));
        assert_eq!(parse("5;"), Some((5, HashSet::new())));
        assert_eq!(parse("x;1"), None);
        assert_eq!(parse("5;1,y"), None);
        assert_eq!(parse("-1;"), None);
        assert_eq!(parse("5"), None);
    }
}
