//! The warm zygote's memory as a read-only file its workers map privately,
//! so that the pages a worker's full garbage collection rewrites with the
//! bytes they already had go back to being shared.
//!
//! R's full collection writes to every object of its heap (mark bits,
//! generation links), so after a session's first one its worker holds a
//! private copy of the whole heap it was forked with: ~35 MB a session
//! without ggplot2, ~85 MB with (docs/process-model.md, "Memory"). Most
//! of those pages end up byte for byte as they were in the zygote, when
//! the zygote ran a full collection itself before it forked: a write that
//! puts back the same bytes still copies the page. The kernel's same-page
//! merging would find them, but across every process of the host (a side
//! channel between tenants) and only when the operator turns it on.
//!
//! So the zygote, once warm and collected, moves its private anonymous
//! memory into a file ([`take`]): each page that holds something written
//! to the file, then the file mapped privately over the same addresses
//! (the contents do not change, nor do the addresses), and only a
//! read-only descriptor of it kept (a memfd is sealed besides). The file
//! is on a tmpfs of huge pages mounted for it alone where the zygote may
//! mount one, so a fork still copies no page table entries for most of
//! the heap (as with the anonymous huge pages of huge.rs before). Its forks
//! map the same file pages; a page a worker writes is copied as before.
//! When the worker is idle after calls ([`give_back`]), it compares each
//! page it holds its own copy of with the file's and drops its copy where
//! they are equal (`MADV_DONTNEED` on a private file mapping: the next
//! access maps the file's page again), so what a session costs is what its
//! state made different. A worker only compares its memory with the image
//! of its own zygote, which it was forked with: nothing it learns is
//! another session's, and a page it gives back is one every worker of
//! that zygote was forked with.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

const PAGE: usize = 4096;

/// A part of the image: `len` bytes mapped at `start`, from `offset` in
/// the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Part {
    start: usize,
    len: usize,
    offset: u64,
    /// Where its pages start in `take`'s list of which pages hold
    /// something.
    holds_from: usize,
}

struct Image {
    file: std::fs::File,
    parts: Vec<Part>,
    /// The worker's own `/proc/self/pagemap` ([`open_pagemap`]).
    pagemap: Option<std::fs::File>,
    /// Pages of the image this worker kept its own copies of at its last
    /// [`give_back`] (they differed).
    kept: usize,
}

/// This process's image: the one its zygote took (inherited by the
/// fork), or its own once it took one.
static IMAGE: Mutex<Option<Image>> = Mutex::new(None);

/// A candidate range of the image: `start..end`, and for a mapping of an
/// earlier image, its offset in that image's file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Range {
    start: usize,
    end: usize,
    earlier: Option<u64>,
}

/// The private, writable memory that makes the image: anonymous mappings
/// (the `[heap]`, malloc's and R's), and those of the image this process
/// was forked with (a zygote forked from a zygote), whose file is
/// `earlier` (`major:minor` of its device as `/proc/self/maps` writes it,
/// and its inode). Not the stack.
fn image_ranges(maps: &str, earlier: Option<(&str, u64)>) -> Vec<Range> {
    let mut out = Vec::new();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms), Some(offset), Some(dev), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let path = f.next();
        let of_earlier = earlier.is_some_and(|(d, i)| d == dev && inode.parse() == Ok(i));
        if perms != "rw-p" || !(of_earlier || matches!(path, None | Some("[heap]"))) {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end), Ok(offset)) = (
            usize::from_str_radix(a, 16),
            usize::from_str_radix(b, 16),
            u64::from_str_radix(offset, 16),
        ) else {
            continue;
        };
        out.push(Range {
            start,
            end,
            earlier: of_earlier.then_some(offset),
        });
    }
    out
}

/// The name of the image's file (in `/proc/PID/maps`, `/rvisor-heap-image
/// (deleted)` or `/memfd:rvisor-heap-image (deleted)`).
const NAME: &std::ffi::CStr = c"rvisor-heap-image";

/// `file`'s device (as `/proc/self/maps` writes it) and inode.
fn device_and_inode(file: &std::fs::File) -> Option<(String, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = file.metadata().ok()?;
    let (major, minor) = (libc::major(m.dev()), libc::minor(m.dev()));
    Some((format!("{major:02x}:{minor:02x}"), m.ino()))
}

/// A new file for the image: on a tmpfs of its own with transparent huge
/// pages (mounted detached: no path anywhere leads to it), so that a
/// worker maps the image's 2 MiB stretches with one entry each, as the
/// zygote's heap was before (a fork copies none of them, a worker's first
/// touch maps 2 MiB); or, where this process may not mount one (not root),
/// a memfd, which the host's setting for shared memory keeps in small
/// pages. The second value says which.
fn new_file() -> Result<(std::fs::File, bool), String> {
    if let Some(f) = huge_tmpfs_file() {
        return Ok((f, true));
    }
    // SAFETY: memfd_create with a static name; the result is checked.
    let fd =
        unsafe { libc::memfd_create(NAME.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    Ok((
        std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) }),
        false,
    ))
}

/// [`new_file`]'s tmpfs: `huge=always`, mounted with the new mount API and
/// never attached; the file root's alone (mode 0400), unlinked at once.
fn huge_tmpfs_file() -> Option<std::fs::File> {
    const FSOPEN_CLOEXEC: libc::c_uint = 1;
    const FSCONFIG_SET_STRING: libc::c_uint = 1;
    const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
    const FSMOUNT_CLOEXEC: libc::c_uint = 1;
    // SAFETY: the new mount API's system calls with static strings; each
    // descriptor returned is checked and owned right away.
    unsafe {
        let fs = libc::syscall(libc::SYS_fsopen, c"tmpfs".as_ptr(), FSOPEN_CLOEXEC);
        if fs < 0 {
            return None;
        }
        let fs = OwnedFd::from_raw_fd(fs as i32);
        let set = |k: &std::ffi::CStr, v: &std::ffi::CStr| {
            libc::syscall(
                libc::SYS_fsconfig,
                fs.as_raw_fd(),
                FSCONFIG_SET_STRING,
                k.as_ptr(),
                v.as_ptr(),
                0,
            ) == 0
        };
        if !set(c"huge", c"always") || !set(c"mode", c"0700") {
            return None;
        }
        let created = libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_char>(),
            0,
        );
        if created != 0 {
            return None;
        }
        let mnt = libc::syscall(libc::SYS_fsmount, fs.as_raw_fd(), FSMOUNT_CLOEXEC, 0);
        if mnt < 0 {
            return None;
        }
        let mnt = OwnedFd::from_raw_fd(mnt as i32);
        let fd = libc::openat(
            mnt.as_raw_fd(),
            NAME.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
            0o400,
        );
        if fd < 0 {
            return None;
        }
        let file = std::fs::File::from(OwnedFd::from_raw_fd(fd));
        libc::unlinkat(mnt.as_raw_fd(), NAME.as_ptr(), 0);
        Some(file)
    }
}

/// The image's file as the workers get it: read-only, and where it is a
/// memfd, sealed against any write (a tmpfs file is root's, mode 0400, on
/// a mount no path reaches: a worker, never root once confined, cannot
/// open it anew for writing). Reopened through `/proc/self/fd`, so no
/// writable descriptor is left.
fn read_only(file: std::fs::File, memfd: bool) -> Result<std::fs::File, String> {
    if memfd {
        // SAFETY: fcntl on the file's own descriptor.
        let sealed = unsafe {
            libc::fcntl(
                file.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            )
        };
        if sealed != 0 {
            return Err(format!("sealing: {}", std::io::Error::last_os_error()));
        }
    }
    std::fs::File::open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(|e| format!("reopening read-only: {e}"))
}

/// `/proc/self/pagemap` bits: the page is present; swapped out; it is a
/// page of a file (or shared anonymous memory) rather than this
/// process's own copy.
const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
const FILE_PAGE: u64 = 1 << 61;

/// Whether this process runs one thread (another could write to memory
/// while it is copied or compared).
fn single_threaded() -> bool {
    std::fs::read_dir("/proc/self/task").is_ok_and(|d| d.count() == 1)
}

/// Runs of consecutive indices of `entries` for which `keep` holds, as
/// `(first, count)`, written into `runs` (no allocation: `runs` has room
/// for one run per entry); returns how many.
fn runs_into<T: Copy>(
    entries: &[T],
    keep: impl Fn(T) -> bool,
    runs: &mut [(usize, usize)],
) -> usize {
    let mut n = 0;
    let mut i = 0;
    while i < entries.len() {
        if !keep(entries[i]) {
            i += 1;
            continue;
        }
        let first = i;
        while i < entries.len() && keep(entries[i]) {
            i += 1;
        }
        if n < runs.len() {
            runs[n] = (first, i - first);
            n += 1;
        }
    }
    n
}

/// The stretches of `file` that hold data (not holes), as byte ranges.
fn data_extents(file: &std::fs::File) -> Vec<(u64, u64)> {
    let fd = file.as_raw_fd();
    let mut out = Vec::new();
    let mut at: libc::off_t = 0;
    loop {
        // SAFETY: lseek on a descriptor `file` owns; a failure (ENXIO past
        // the last data) ends the walk.
        let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
        if data < 0 {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole <= data {
            break;
        }
        out.push((data as u64, hole as u64));
        at = hole;
    }
    out
}

/// Where in the file a part of `len` bytes at address `start` goes, the
/// file's parts so far ending at `end`: on a file of huge pages, a part
/// of 2 MiB or more at an offset congruent to its address modulo 2 MiB
/// (so that its aligned stretches are huge pages the mapping can map
/// whole), after a hole; otherwise right after.
fn place(end: u64, start: usize, len: usize, huge: bool) -> u64 {
    const HUGE: u64 = 2 << 20;
    if !huge || (len as u64) < HUGE {
        return end;
    }
    let base = end.div_ceil(HUGE) * HUGE;
    base + start as u64 % HUGE
}

/// A range goes into the image when at least this share of its pages
/// hold something (the rest, read as zeros, would be pages of the file
/// that a first write by any worker fills in: a 64 MiB reservation with a
/// few pages used is left as it is).
fn worth_imaging(holding: usize, pages: usize) -> bool {
    holding * 4 >= pages * 3
}

/// Takes the image: this process's private memory into a file
/// ([`new_file`]), mapped back privately where it was, the file then
/// read-only ([`read_only`]). Called in a zygote that is warm,
/// collected and single-threaded, before it forks the workers that will
/// use it; returns the bytes in the image, or why it was not taken (the
/// zygote then goes on as it was: its workers just keep their copies).
pub fn take() -> Result<usize, String> {
    if !single_threaded() {
        return Err("the zygote runs more than one thread".into());
    }
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(|e| e.to_string())?;
    // The image this process was forked with, if any: its pages not
    // present here hold that file's bytes (holes read zeros).
    let (earlier, earlier_data) = {
        let image = IMAGE.lock().unwrap_or_else(|e| e.into_inner());
        match image.as_ref() {
            Some(i) => (device_and_inode(&i.file), data_extents(&i.file)),
            None => (None, Vec::new()),
        }
    };
    let ranges = image_ranges(&maps, earlier.as_ref().map(|(d, i)| (d.as_str(), *i)));
    let pages: usize = ranges.iter().map(|r| (r.end - r.start) / PAGE).sum();
    let pagemap = std::fs::File::open("/proc/self/pagemap").map_err(|e| e.to_string())?;
    let (file, huge) = new_file()?;
    // Everything the copy needs is allocated (and written, so present)
    // before it starts: from the first page table entry read to the last
    // mapping made, nothing may write to the memory being copied, or the
    // write is lost (this thread allocates nothing meanwhile; signals
    // wait).
    let mut holds = vec![false; pages];
    let mut raw = vec![0u8; 512 * 8];
    let mut runs = vec![(0usize, 0usize); pages];
    let mut parts: Vec<Part> = Vec::with_capacity(ranges.len());
    let mut bytes = 0;
    // No signal handler runs (and writes) until the mask is restored below.
    let held = SignalsHeld::new();
    let mut failed: Option<&str> = None;
    // Which pages hold something: present or swapped out, or, in a
    // mapping of an earlier image, data of its file.
    let mut done = 0;
    'ranges: for r in &ranges {
        let n = (r.end - r.start) / PAGE;
        let ours = &mut holds[done..done + n];
        for (k, chunk) in ours.chunks_mut(512).enumerate() {
            let at = ((r.start / PAGE + k * 512) * 8) as u64;
            let want = &mut raw[..chunk.len() * 8];
            if pagemap.read_exact_at(want, at).is_err() {
                failed = Some("reading /proc/self/pagemap failed");
                break 'ranges;
            }
            for (j, (h, c)) in chunk.iter_mut().zip(want.chunks_exact(8)).enumerate() {
                let e = entry(c);
                let in_file = r.earlier.is_some_and(|off| {
                    let at = off + ((k * 512 + j) * PAGE) as u64;
                    earlier_data.iter().any(|&(a, b)| a <= at && at < b)
                });
                *h = e & (PRESENT | SWAPPED) != 0 || in_file;
            }
        }
        let holding = ours.iter().filter(|h| **h).count();
        if worth_imaging(holding, n) {
            let end = parts.last().map_or(0, |p| p.offset + p.len as u64);
            let offset = place(end, r.start, r.end - r.start, huge);
            parts.push(Part {
                start: r.start,
                len: r.end - r.start,
                offset,
                holds_from: done,
            });
        }
        done += n;
    }
    if failed.is_none() {
        'copy: for part in &parts {
            let n = part.len / PAGE;
            let count = runs_into(
                &holds[part.holds_from..part.holds_from + n],
                |h| h,
                &mut runs,
            );
            for &(first, len) in &runs[..count] {
                let addr = part.start + first * PAGE;
                // SAFETY: `addr..addr + len * PAGE` is this process's own
                // readable mapping (read from /proc/self/maps; nothing has
                // unmapped it since: this thread is the only one).
                let src = unsafe { std::slice::from_raw_parts(addr as *const u8, len * PAGE) };
                if file
                    .write_all_at(src, part.offset + (first * PAGE) as u64)
                    .is_err()
                {
                    failed = Some("writing the image failed");
                    break 'copy;
                }
                bytes += len * PAGE;
            }
        }
    }
    let size = parts
        .iter()
        .map(|p| p.offset + p.len as u64)
        .max()
        .unwrap_or(0);
    if failed.is_none() && file.set_len(size).is_err() {
        failed = Some("sizing the image failed");
    }
    if failed.is_none() {
        for part in &parts {
            // SAFETY: maps the file privately over the range it was just
            // copied from, at the same address and of the same length:
            // every page that held something reads what it held (nothing
            // wrote since the copy), and the others read zeros, as they
            // did. MAP_FIXED replaces the old mapping in one step.
            let p = unsafe {
                libc::mmap(
                    part.start as *mut libc::c_void,
                    part.len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_FIXED,
                    file.as_raw_fd(),
                    part.offset as libc::off_t,
                )
            };
            if p == libc::MAP_FAILED {
                // The range may be unmapped: the process cannot go on.
                // SAFETY: ends the process at once (the supervisor sees
                // the zygote die and starts another).
                unsafe { libc::_exit(75) };
            }
        }
    }
    drop(held);
    if let Some(e) = failed {
        return Err(e.into());
    }
    // No worker may write to the file: it is mapped into every worker of
    // every tenant.
    let file = read_only(file, !huge).map_err(|e| {
        // No descriptor of it is kept then (the private mappings cannot
        // write to it): the workers keep their copies.
        format!("the image could not be made read-only: {e}")
    })?;
    // The whole image mapped once more in this process, read-only and
    // shared, in a view no fork inherits and nothing writes to: every page
    // of it counts where the memory is measured (shared with the workers
    // that map it too), whatever the zygote's own mappings have dropped
    // since (a write of the zygote's to a stretch mapped whole unmaps
    // the stretch). The private mappings are left to map what the zygote
    // touches: a fork copies only those entries (and none of a huge page
    // of a file, which a worker maps again at its first touch).
    // SAFETY: a new shared, read-only mapping of the file, through a
    // read-only descriptor (it can never be made writable); the advice
    // only concerns it.
    unsafe {
        let view = libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        );
        if view != libc::MAP_FAILED {
            libc::madvise(view, size as usize, libc::MADV_DONTFORK);
            // Only the pages that hold something (a read of a hole would
            // fill it).
            for part in &parts {
                let n = part.len / PAGE;
                let h = &holds[part.holds_from..part.holds_from + n];
                let count = runs_into(h, |h| h, &mut runs);
                for &(first, len) in &runs[..count] {
                    let at = view.cast::<u8>().add(part.offset as usize + first * PAGE);
                    libc::madvise(at.cast(), len * PAGE, MADV_POPULATE_READ);
                }
            }
        }
    }
    let mut image = IMAGE.lock().unwrap_or_else(|e| e.into_inner());
    *image = Some(Image {
        file,
        parts,
        pagemap: None,
        kept: 0,
    });
    Ok(bytes)
}

/// `madvise(2)` advice not in every libc crate's list.
const MADV_POPULATE_READ: libc::c_int = 22;

/// This process's `/proc/self/pagemap`, opened without CAP_SYS_ADMIN
/// (so reading it shows no physical addresses, which would help an attack
/// on the memory's rows; the flags [`give_back`] reads are there anyway).
fn own_pagemap() -> Option<std::fs::File> {
    crate::caps::without_sys_admin(|| std::fs::File::open("/proc/self/pagemap").ok())
}

/// Opens this worker's pagemap for [`give_back`], if it has an image:
/// right after the fork, before confinement changes its credentials
/// (after, it is not dumpable and its /proc files are root's; the
/// descriptor stays this process's pagemap wherever /proc is then).
pub fn open_pagemap() {
    let mut image = IMAGE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = image.as_mut() {
        if i.pagemap.is_none() {
            i.pagemap = own_pagemap();
        }
    }
}

/// What [`give_back`] did.
#[derive(Debug, Default, Clone, Copy)]
pub struct GivenBack {
    /// Pages of the image this process held its own copy of.
    pub own: usize,
    /// Of those, the ones equal to the image's and dropped.
    pub dropped: usize,
    /// Whether it stopped early (`stop` said so).
    pub stopped: bool,
}

/// Drops this process's copies of image pages that equal the image's
/// (see the module's doc), checking `stop` between stretches of 2 MiB and
/// returning early when it says so (a request came). `collected`: R ran
/// a garbage collection since the last time, which may have put back
/// pages the worker already had its own copies of (they are compared
/// again); otherwise only when many more became its own. Only between calls,
/// on R's thread: nothing else may write to the memory meanwhile.
pub fn give_back(mut stop: impl FnMut() -> bool, collected: bool) -> GivenBack {
    let mut got = GivenBack::default();
    let mut image = IMAGE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(Image {
        file,
        parts,
        pagemap,
        kept,
    }) = image.as_mut()
    else {
        return got;
    };
    if pagemap.is_none() {
        *pagemap = own_pagemap();
    }
    let Some(pagemap) = pagemap.as_ref() else {
        return got;
    };
    if !single_threaded() {
        return got;
    }
    // Free memory inside malloc's heap goes back first (glibc's trim:
    // those pages of the image read the image again, the others zeros).
    // SAFETY: on R's thread, the only one, between calls.
    unsafe { libc::malloc_trim(0) };
    if stop() {
        got.stopped = true;
        return got;
    }
    let own = |e: u64| e & PRESENT != 0 && e & FILE_PAGE == 0;
    let Some(entries) = read_entries(pagemap, parts) else {
        return got;
    };
    if stop() {
        got.stopped = true;
        return got;
    }
    let now = entries.iter().filter(|e| own(**e)).count();
    if !collected && now < *kept + MIN_NEW {
        // No collection ran, and too few pages became this process's own
        // since the last time, for a comparison to pay.
        got.own = now;
        *kept = (*kept).min(now);
        return got;
    }
    const CHUNK: usize = 512;
    // 16 pages at a time: a buffer malloc keeps on its heap.
    const READ: usize = 16;
    let mut theirs = vec![0u8; READ * PAGE];
    let mut runs = [(0usize, 0usize); CHUNK];
    let mut done = 0;
    for part in parts.iter() {
        let pages = part.len / PAGE;
        for first in (0..pages).step_by(CHUNK) {
            if stop() {
                got.stopped = true;
                return got;
            }
            let n = CHUNK.min(pages - first);
            let count = runs_into(&entries[done + first..done + first + n], own, &mut runs);
            for &(i, len) in &runs[..count] {
                got.own += len;
                for j in (0..len).step_by(READ) {
                    let k = READ.min(len - j);
                    let page = first + i + j;
                    let buf = &mut theirs[..k * PAGE];
                    if file
                        .read_exact_at(buf, part.offset + (page * PAGE) as u64)
                        .is_ok()
                    {
                        got.dropped += drop_equal(part.start + page * PAGE, buf);
                    }
                }
            }
        }
        done += pages;
    }
    *kept = got.own - got.dropped;
    got
}

/// How many more pages of the image must have become this process's own
/// since the last [`give_back`] for it to compare them (4 MiB: a full
/// collection makes thousands; a call that ran none, a few dozen).
const MIN_NEW: usize = 1024;

/// The pagemap entries of every page of `parts`, in order.
fn read_entries(pagemap: &std::fs::File, parts: &[Part]) -> Option<Vec<u64>> {
    let pages: usize = parts.iter().map(|p| p.len / PAGE).sum();
    let mut raw = vec![0u8; pages * 8];
    let mut at = 0;
    for part in parts {
        let n = part.len / PAGE;
        pagemap
            .read_exact_at(&mut raw[at..at + n * 8], (part.start / PAGE * 8) as u64)
            .ok()?;
        at += n * 8;
    }
    Some(raw.chunks_exact(8).map(entry).collect())
}

/// Drops the pages at `addr` (as many as `theirs` holds) that equal
/// `theirs` and are not all zeros (a page of zeros may be a hole of the
/// file, which a read would fill); returns how many it dropped.
fn drop_equal(addr: usize, theirs: &[u8]) -> usize {
    let mut dropped = 0;
    // Signals wait while pages are compared and dropped: a handler that
    // wrote to a page between the two would lose its write.
    let _held = SignalsHeld::new();
    let pages = theirs.len() / PAGE;
    let mut k = 0;
    let same = |j: usize| {
        let t = &theirs[j * PAGE..(j + 1) * PAGE];
        // SAFETY: `addr` is the start of `pages` pages of this process's
        // image mapping (read from its own pagemap just before; only this
        // thread runs, so nothing unmapped them).
        let m = unsafe { std::slice::from_raw_parts((addr + j * PAGE) as *const u8, PAGE) };
        m == t && t.iter().any(|&b| b != 0)
    };
    while k < pages {
        if !same(k) {
            k += 1;
            continue;
        }
        let first = k;
        while k < pages && same(k) {
            k += 1;
        }
        // SAFETY: the pages `first..k` hold exactly the bytes of the file
        // at their place (compared just above, with signals blocked and no
        // other thread): dropping this process's copies maps the file's
        // pages again at the next access, which read the same bytes.
        let rc = unsafe {
            libc::madvise(
                (addr + first * PAGE) as *mut libc::c_void,
                (k - first) * PAGE,
                libc::MADV_DONTNEED,
            )
        };
        if rc == 0 {
            dropped += k - first;
        }
    }
    dropped
}

/// Every signal blocked for this thread until it is dropped, when the
/// mask before is restored.
struct SignalsHeld(libc::sigset_t);

impl SignalsHeld {
    fn new() -> Self {
        // SAFETY: sigfillset/sigprocmask on local sets.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::sigprocmask(libc::SIG_SETMASK, &all, &mut old);
            SignalsHeld(old)
        }
    }
}

impl Drop for SignalsHeld {
    fn drop(&mut self) {
        // SAFETY: restores the mask `new` saved.
        unsafe { libc::sigprocmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }
}

/// One `/proc/self/pagemap` entry from its 8 bytes.
fn entry(c: &[u8]) -> u64 {
    u64::from_ne_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_image_is_the_private_writable_memory_and_an_earlier_image() {
        let maps = [
            "55d0c0000000-55d0c0a00000 rw-p 00000000 00:00 0          [heap]",
            "7f0000000000-7f0000500000 rw-p 00000000 00:00 0",
            "7f0000600000-7f0000700000 r--p 00000000 08:01 1234       /usr/lib/libR.so",
            "7f0000800000-7f0000c00000 rw-p 00010000 08:01 1234       /usr/lib/libR.so",
            "7f0001000000-7f0001100000 rw-p 0261a000 00:2f 77         /rvisor-heap-image (deleted)",
            "7f0001200000-7f0001300000 rw-p 00000000 00:2f 78         /rvisor-heap-image (deleted)",
            "7f0002000000-7f0002100000 rw-s 00000000 00:01 79         /memfd:other (deleted)",
            "7f0003000000-7f0003100000 ---p 00000000 00:00 0",
            "7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0          [stack]",
        ]
        .join("\n");
        let r = |start, end, earlier| Range {
            start,
            end,
            earlier,
        };
        assert_eq!(
            image_ranges(&maps, Some(("00:2f", 77))),
            vec![
                r(0x55d0c0000000, 0x55d0c0a00000, None),
                r(0x7f0000000000, 0x7f0000500000, None),
                r(0x7f0001000000, 0x7f0001100000, Some(0x261a000)),
            ]
        );
        assert_eq!(image_ranges(&maps, None).len(), 2);
    }

    #[test]
    fn big_parts_go_where_huge_pages_line_up_with_their_addresses() {
        const M2: u64 = 2 << 20;
        // Small parts, or a file of small pages: one after the other.
        assert_eq!(place(4096, 0x7f00_0000_3000, 8192, true), 4096);
        assert_eq!(place(4096, 0x7f00_0000_3000, 64 << 20, false), 4096);
        // A big part: after a hole, congruent to its address.
        let off = place(4096, 0x55d0_c012_3000, 33 << 20, true);
        assert_eq!(off % M2, 0x12_3000 % M2);
        assert!((4096..4096 + 2 * M2).contains(&off));
        assert_eq!(place(2 * M2, 0x55d0_c000_0000, 4 << 20, true), 2 * M2);
    }

    #[test]
    fn a_range_mostly_unused_is_left_out() {
        assert!(worth_imaging(8459, 8457 + 2));
        assert!(worth_imaging(3, 4));
        assert!(!worth_imaging(2, 16384), "a reservation with 2 pages used");
        assert!(!worth_imaging(2, 4));
    }

    #[test]
    fn runs_are_the_stretches_that_match() {
        let e = [1u64, 1, 0, 1, 0, 0, 1, 1, 1];
        let mut runs = [(0, 0); 9];
        let n = runs_into(&e, |x| x == 1, &mut runs);
        assert_eq!(&runs[..n], &[(0, 2), (3, 1), (6, 3)]);
        let n = runs_into(&[0, 0], |x| x == 1, &mut runs);
        assert_eq!(n, 0);
    }
}
