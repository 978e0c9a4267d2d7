//! The warm zygote's heap in huge pages, so that a fork copies one page
//! table entry per 2 MiB of it instead of 512.
//!
//! A fork's cost in the zygote is mostly the kernel copying the page
//! tables of the zygote's anonymous memory (R's heap: ~46 MB in the warm
//! zygote, ~100 MB in the preloaded one) and taking a reference on each
//! page; a worker's exit undoes it. Once warm, the zygote asks the kernel
//! to collapse its heap's 2 MiB-aligned stretches into transparent huge
//! pages (`MADV_COLLAPSE`, Linux 6.1; it works whatever the host's THP
//! setting), which a fork then shares with one entry each. A worker that
//! writes to such a stretch gets the 4 KiB page it wrote copied, as
//! before (the kernel splits the huge page's mapping in that worker
//! only), so what a session costs in memory is unchanged; the stretches
//! a worker never writes stay shared whole. Measured in
//! docs/process-model.md ("A new worker").

/// The anonymous, private, writable mappings of this process (and its
/// `[heap]`), as `(start, end)` from `/proc/self/maps`.
fn anonymous_ranges(maps: &str) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        // offset, device, inode, then the path (none for anonymous memory)
        let path = f.nth(3);
        if perms != "rw-p" || !matches!(path, None | Some("[heap]")) {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
            out.push((a, b));
        }
    }
    out
}

/// The 2 MiB-aligned part of `(start, end)`, if any.
fn aligned((start, end): (usize, usize)) -> Option<(usize, usize)> {
    const HUGE: usize = 2 << 20;
    let s = start.checked_add(HUGE - 1)? & !(HUGE - 1);
    let e = end & !(HUGE - 1);
    (e > s).then_some((s, e))
}

/// `madvise(2)`'s MADV_COLLAPSE (not in every libc crate's list).
const MADV_COLLAPSE: libc::c_int = 25;

const PAGE: usize = 4096;
const HUGE_PAGES: usize = (2 << 20) / PAGE;

/// Most pages of a 2 MiB stretch that may still be shared with another
/// process (the zygote this one was forked from) for it to be collapsed:
/// the collapse copies them, and the other process then holds its own
/// alone, 128 KiB more memory at most per stretch.
const MAX_SHARED: usize = 32;

/// Whether a 2 MiB stretch, by its 512 `/proc/self/pagemap` entries, is
/// worth collapsing: nearly every page present is this process's alone
/// (at most [`MAX_SHARED`] are not; a stretch mostly shared would be
/// copied whole, and the other process would keep its pages as well),
/// and at least half are present (the kernel fills the missing ones with
/// zeros).
fn worth_collapsing(entries: &[u64]) -> bool {
    const PRESENT: u64 = 1 << 63;
    const EXCLUSIVE: u64 = 1 << 56;
    let present = entries.iter().filter(|e| *e & PRESENT != 0).count();
    let shared = entries
        .iter()
        .filter(|e| *e & PRESENT != 0 && *e & EXCLUSIVE == 0)
        .count();
    present >= entries.len() / 2 && shared <= MAX_SHARED
}

/// Collapses this process's anonymous memory into huge pages where it
/// can and where its pages are its own ([`worth_collapsing`]); returns
/// the bytes collapsed. A kernel without MADV_COLLAPSE, or memory it
/// cannot collapse, leaves pages as they are.
pub fn collapse_heap() -> usize {
    use std::os::unix::fs::FileExt;
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let Ok(pagemap) = std::fs::File::open("/proc/self/pagemap") else {
        return 0;
    };
    let mut raw = vec![0u8; HUGE_PAGES * 8];
    let mut bytes = 0;
    for (start, end) in anonymous_ranges(&maps).into_iter().filter_map(aligned) {
        for s in (start..end).step_by(HUGE_PAGES * PAGE) {
            if pagemap
                .read_exact_at(&mut raw, (s / PAGE * 8) as u64)
                .is_err()
            {
                continue;
            }
            let entries: Vec<u64> = raw
                .chunks_exact(8)
                .map(|c| u64::from_ne_bytes(c.try_into().unwrap_or_default()))
                .collect();
            if !worth_collapsing(&entries) {
                continue;
            }
            // SAFETY: advice on a stretch of this process's own private
            // anonymous mappings (read just above; the zygote is
            // single-threaded, so none is unmapped meanwhile). MADV_COLLAPSE
            // only changes how the pages are backed, never their contents;
            // a failure changes nothing.
            let rc =
                unsafe { libc::madvise(s as *mut libc::c_void, HUGE_PAGES * PAGE, MADV_COLLAPSE) };
            if rc == 0 {
                bytes += HUGE_PAGES * PAGE;
            }
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_private_anonymous_memory_is_taken_and_aligned() {
        let maps = [
            "55d0c0000000-55d0c0a00000 rw-p 00000000 00:00 0          [heap]",
            "7f0000000000-7f0000500000 rw-p 00000000 00:00 0",
            "7f0000600000-7f0000700000 r--p 00000000 08:01 1234       /usr/lib/libR.so",
            "7f0000800000-7f0000c00000 rw-p 00010000 08:01 1234       /usr/lib/libR.so",
            "7f0001000000-7f0001100000 rw-p 00000000 00:00 0",
            "7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0          [stack]",
        ]
        .join("\n");
        let r = anonymous_ranges(&maps);
        assert_eq!(
            r,
            vec![
                (0x55d0c0000000, 0x55d0c0a00000),
                (0x7f0000000000, 0x7f0000500000),
                (0x7f0001000000, 0x7f0001100000),
            ]
        );
        let a: Vec<_> = r.into_iter().filter_map(aligned).collect();
        assert_eq!(
            a,
            vec![
                (0x55d0c0000000, 0x55d0c0a00000),
                (0x7f0000000000, 0x7f0000400000),
            ]
        );
        assert_eq!(aligned((0x1000, 0x3ff000)), None);
        assert_eq!(aligned((0x1000, 0x400000)), Some((0x200000, 0x400000)));
    }

    #[test]
    fn only_stretches_mostly_present_and_all_our_own_are_collapsed() {
        let (present, own) = (1u64 << 63, 1u64 << 56);
        let mine = vec![present | own; HUGE_PAGES];
        assert!(worth_collapsing(&mine));
        let mut shared = mine.clone();
        shared[..MAX_SHARED].fill(present); // still shared with the parent
        assert!(worth_collapsing(&shared));
        shared[MAX_SHARED] = present;
        assert!(!worth_collapsing(&shared), "too many pages shared");
        let mut sparse = vec![0u64; HUGE_PAGES];
        sparse[..HUGE_PAGES / 2].fill(present | own);
        assert!(worth_collapsing(&sparse));
        sparse[0] = 0;
        assert!(!worth_collapsing(&sparse), "fewer than half present");
    }
}
