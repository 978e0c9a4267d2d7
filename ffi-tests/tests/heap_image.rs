//! The warm zygote's heap image (embedded-worker/src/heap_image.rs): a
//! worker maps the zygote's memory from a sealed file, a full collection
//! makes its own copies, and once it idles it gives back the copies that
//! still equal the image, without changing what its session holds. And no
//! one can write to the image, which every worker of every tenant maps,
//! nor read physical addresses from the pagemap a worker keeps open.
//!
//! Real R, confined workers (the tests run as root, as confinement
//! requires). No test sleeps and hopes: each waits for a condition by
//! polling it (or for a file the worker writes), with a generous deadline.

use rvisor::{Outcome, PoolConfig, RunResult, Session, Supervisor, SupervisorConfig};
use rvisor_ffi_tests::{inside, wait_for};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(120);

/// How `/proc/<pid>/maps` names the image's mappings (a file on a tmpfs of
/// its own, `/rvisor-heap-image (deleted)`, or a memfd,
/// `/memfd:rvisor-heap-image (deleted)`).
const IMAGE: &str = "rvisor-heap-image (deleted)";

fn ready_supervisor() -> Supervisor {
    let sup = Supervisor::new(SupervisorConfig {
        pool: PoolConfig::default(),
        ..SupervisorConfig::default()
    })
    .expect("supervisor starts");
    assert!(
        sup.pool().wait_ready(DEADLINE),
        "the zygote did not come up: {:?}",
        sup.pool_status()
    );
    sup
}

fn call_ok(s: &Session, code: &str) -> RunResult {
    let r = s
        .run(code)
        .expect("the call is accepted")
        .wait_timeout(DEADLINE)
        .unwrap_or_else(|| panic!("no result for {code:?} within {DEADLINE:?}"));
    assert_eq!(
        r.outcome,
        Outcome::Complete,
        "{code:?}: error {:?}, console {:?}",
        r.error,
        r.console
    );
    r
}

/// Kilobytes of the image's mappings in process `pid`: resident, and of
/// those its own copies (`Private_Dirty`).
fn image_kb(pid: u32) -> (u64, u64) {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
        .unwrap_or_else(|e| panic!("read /proc/{pid}/smaps: {e}"));
    let (mut rss, mut private, mut ours) = (0, 0, false);
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        match (f.next(), f.next()) {
            (Some(k), Some(v)) if k.ends_with(':') => {
                let v: u64 = v.parse().unwrap_or(0);
                match k {
                    "Rss:" if ours => rss += v,
                    "Private_Dirty:" if ours => private += v,
                    _ => {}
                }
            }
            // A mapping's header line: its range first.
            (Some(range), Some(_)) if range.contains('-') => ours = line.contains(IMAGE),
            _ => {}
        }
    }
    (rss, private)
}

/// The image's descriptor in process `pid`, as a path under /proc.
fn image_fd(pid: u32) -> PathBuf {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("read the worker's descriptors")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| std::fs::read_link(p).is_ok_and(|t| t.to_string_lossy().ends_with(IMAGE)))
        .unwrap_or_else(|| panic!("worker {pid} holds no descriptor of the heap image"))
}

/// Runs `code` in `s` (worker `pid`), then a full collection, and measures
/// the image's pages the worker made its own while it is still busy (so it
/// has given nothing back yet): the call then waits on a FIFO the test
/// writes to once it has measured (a wait without a loop, which R's JIT
/// would compile in the session). Returns the pages (KB) and what `code`
/// printed.
fn collect_and_measure(s: &Session, pid: u32, code: &str) -> (u64, String) {
    let tmp = call_ok(s, "cat(tempdir())").console;
    let at = |name: &str| inside(pid, &Path::new(&tmp).join(name));
    let _ = std::fs::remove_file(at("collected"));
    let _ = std::fs::remove_file(at("go"));
    let fifo = std::ffi::CString::new(at("go").into_os_string().into_encoded_bytes())
        .expect("a path without NUL");
    // SAFETY: mkfifo/chmod on a path this test made (a C string it owns);
    // the worker's user is not root, so the FIFO is opened to everyone.
    unsafe {
        assert_eq!(libc::mkfifo(fifo.as_ptr(), 0o666), 0, "mkfifo");
        libc::chmod(fifo.as_ptr(), 0o666);
    }
    let code = format!(
        "{code}\ninvisible(gc()); writeLines('1', file.path(tempdir(), 'collected'))\n\
         local({{ con <- fifo(file.path(tempdir(), 'go'), 'r', blocking = TRUE); \
         on.exit(close(con)); invisible(readLines(con, n = 1)) }})"
    );
    let handle = s.run(&code).expect("the call is accepted");
    wait_for("the worker's full collection", DEADLINE, || {
        at("collected").exists().then_some(())
    });
    let (_, copied) = image_kb(pid);
    std::fs::write(at("go"), "go\n").expect("tell the worker to go on");
    let r = handle.wait_timeout(DEADLINE).expect("the call ends");
    assert_eq!(r.outcome, Outcome::Complete, "{:?}", r.error);
    (copied, r.console)
}

/// Descriptor `n` of process `pid`, the same open file taken into this
/// process (pidfd_getfd; the tests run as root).
fn take_fd(pid: u32, n: i32) -> std::fs::File {
    // SAFETY: pidfd_open/pidfd_getfd on the worker; the descriptors
    // returned are checked and owned right away.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0);
        assert!(
            pidfd >= 0,
            "pidfd_open: {}",
            std::io::Error::last_os_error()
        );
        let pidfd = std::os::fd::OwnedFd::from_raw_fd(pidfd as i32);
        let got = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), n, 0);
        assert!(got >= 0, "pidfd_getfd: {}", std::io::Error::last_os_error());
        std::fs::File::from(std::os::fd::OwnedFd::from_raw_fd(got as i32))
    }
}

fn worker_pid(s: &Session) -> u32 {
    call_ok(s, "invisible(0)");
    s.status().pid.expect("the session's worker pid")
}

#[test]
fn a_worker_gives_its_copies_of_the_zygotes_heap_back_when_idle_and_keeps_its_state() {
    let sup = ready_supervisor();
    let s = sup.session().expect("session");
    let pid = worker_pid(&s);
    assert!(
        image_kb(pid).0 > 0,
        "the worker maps nothing of the zygote's heap image"
    );
    // (No closure called twice, no loop: R's JIT compiling one in the
    // session allocates enough to leave fewer pages as they were.)
    let code = "set.seed(3); v <- rnorm(1e5); s0 <- sum(v); f <- function(x) x * 2
                words <- paste0('w', 1:5000)
                cat(format(s0, digits = 17))";
    let (copied, s0) = collect_and_measure(&s, pid, code);
    assert!(
        copied > 8 * 1024,
        "a full collection made only {copied} KB of the image the worker's own"
    );
    let given = wait_for("the worker's copies given back", DEADLINE, || {
        let (_, now) = image_kb(pid);
        (now * 2 < copied).then_some(now)
    });
    eprintln!("image pages of its own: {copied} KB after gc(), {given} KB once idle");
    // What the session holds is what it held.
    let check = "cat(format(sum(v), digits = 17), f(21), length(words), words[4321], \
                 identical(words, sprintf('w%d', 1:5000)))";
    let want = format!("{s0} 42 5000 w4321 TRUE");
    assert_eq!(call_ok(&s, check).console, want);
    // Again after another collection and another give-back.
    let (copied, _) = collect_and_measure(&s, pid, "x <- lapply(1:20000, function(i) c(i, i))");
    wait_for("the copies given back again", DEADLINE, || {
        let (_, now) = image_kb(pid);
        (now < copied).then_some(())
    });
    assert_eq!(call_ok(&s, check).console, want);
    let total = call_ok(&s, "cat(sum(vapply(x, sum, 0)))").console;
    assert_eq!(total, "400020000");
}

#[test]
fn a_worker_cannot_write_to_the_heap_image() {
    use std::os::unix::fs::MetadataExt;
    let sup = ready_supervisor();
    let s = sup.session().expect("session");
    let pid = worker_pid(&s);
    let fd = image_fd(pid);
    let n: i32 = fd
        .file_name()
        .and_then(|f| f.to_str())
        .and_then(|f| f.parse().ok())
        .expect("a descriptor number");
    // The worker's descriptor is read-only: the same open file, taken
    // into this process, refuses a write.
    let theirs = take_fd(pid, n);
    let mut first = [0u8; 16];
    theirs
        .read_exact_at(&mut first, 0)
        .expect("the image reads");
    let err = theirs
        .write_at(b"overwritten", 0)
        .expect_err("a write through the worker's descriptor must fail");
    assert_eq!(err.raw_os_error(), Some(libc::EBADF), "{err}");
    // A shared writable mapping of it is refused too.
    // SAFETY: mmap of a file this test holds; a success is unmapped.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            theirs.as_raw_fd(),
            0,
        )
    };
    let mapped = p != libc::MAP_FAILED;
    if mapped {
        // SAFETY: unmaps what was just mapped.
        unsafe { libc::munmap(p, 4096) };
    }
    assert!(!mapped, "the image could be mapped shared and writable");
    // Nor can it be opened anew for writing by the worker: a memfd is
    // sealed against writes; a tmpfs file is root's alone and linked
    // nowhere, and the worker's user is not root.
    let meta = theirs.metadata().expect("the image's metadata");
    assert_eq!(meta.nlink(), 0, "the image has a name somewhere");
    // SAFETY: fcntl on a descriptor this test owns.
    let seals = unsafe { libc::fcntl(theirs.as_raw_fd(), libc::F_GET_SEALS) };
    let sealed = seals >= 0 && seals & libc::F_SEAL_WRITE != 0;
    let worker_uid = std::fs::metadata(format!("/proc/{pid}"))
        .expect("the worker's /proc")
        .uid();
    assert!(
        sealed || (meta.uid() == 0 && meta.mode() & 0o777 == 0o400 && worker_uid != 0),
        "the image is neither sealed nor root's alone (uid {}, mode {:o}, worker uid {worker_uid})",
        meta.uid(),
        meta.mode()
    );
    // From inside, R cannot open it for writing either.
    let code = format!(
        "r <- tryCatch({{ con <- file('/proc/self/fd/{n}', 'r+b'); close(con); 'opened' }}, \
         error = function(e) 'refused', warning = function(w) 'refused'); cat(r)"
    );
    assert_eq!(call_ok(&s, &code).console, "refused");
    let mut again = [0u8; 16];
    theirs
        .read_exact_at(&mut again, 0)
        .expect("the image reads");
    assert_eq!(first, again);
    assert_eq!(call_ok(&s, "cat(1 + 1)").console, "2");
}

#[test]
fn workers_of_the_preloaded_zygote_map_its_own_image_and_draw() {
    let sup = ready_supervisor();
    let s = sup.session().expect("session");
    // Naming ggplot2 first: a worker of the preloaded zygote.
    call_ok(&s, "library(ggplot2)");
    let pid = s.status().pid.expect("pid");
    assert!(image_kb(pid).0 > 0, "no heap image mapped");
    let plot = "print(ggplot(mtcars, aes(wt, mpg)) + geom_point())";
    let r = call_ok(&s, plot);
    assert_eq!(r.plots.len(), 1, "one plot: {:?}", r.console);
    let (copied, _) = collect_and_measure(&s, pid, "p <- ggplot(mtcars, aes(wt, mpg))");
    wait_for("the copies given back", DEADLINE, || {
        let (_, now) = image_kb(pid);
        (now < copied).then_some(())
    });
    let r = call_ok(&s, plot);
    assert_eq!(r.plots.len(), 1, "one plot after the give-back");
    assert_eq!(
        call_ok(&s, "cat(nrow(ggplot2::mpg), exists('geom_smooth'))").console,
        "234 TRUE"
    );
}

#[test]
fn a_workers_pagemap_shows_no_physical_addresses() {
    let sup = ready_supervisor();
    let s = sup.session().expect("session");
    let pid = worker_pid(&s);
    // The descriptor of its own pagemap it opened before its credentials
    // changed, taken into this process (root: pidfd_getfd may).
    let fd = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("read the worker's descriptors")
        .filter_map(Result::ok)
        .find(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.ends_with("pagemap")))
        .and_then(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .expect("the worker holds its pagemap open");
    let pagemap = take_fd(pid, fd);
    // Its image mappings: present pages, and not one physical address.
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mut present = 0;
    for line in maps.lines().filter(|l| l.contains(IMAGE)) {
        let (a, b) = line
            .split_whitespace()
            .next()
            .and_then(|r| r.split_once('-'))
            .expect("a range");
        let (a, b) = (
            u64::from_str_radix(a, 16).expect("hex"),
            u64::from_str_radix(b, 16).expect("hex"),
        );
        let n = ((b - a) / 4096).min(4096) as usize;
        let mut raw = vec![0u8; n * 8];
        pagemap
            .read_exact_at(&mut raw, a / 4096 * 8)
            .expect("read the worker's pagemap");
        for c in raw.chunks_exact(8) {
            let e = u64::from_ne_bytes(c.try_into().expect("8 bytes"));
            if e >> 63 == 1 {
                present += 1;
                assert_eq!(
                    e & ((1 << 55) - 1),
                    0,
                    "a physical page number shows: {e:#x}"
                );
            }
        }
    }
    assert!(present > 0, "no page of the image is present in the worker");
}
