//! Giving freed heap back to the system. glibc's allocator keeps what a
//! large piece of work freed (a table conversion, the output of a call a
//! slow client was sent) for the process's life unless asked to return
//! it, so the server's resident memory would stay at its peak.

/// A stream that held at least this much (events and result) asks for its
/// memory back when it ends: the cost of one trim (a walk of the free
/// lists, ~1 ms here) is then small beside what it returns.
pub const TRIM_AFTER_BYTES: usize = 1 << 20;

/// Returns the heap's free pages to the system (`malloc_trim`); nothing
/// on other allocators.
pub fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists under
    // its lock; it takes no pointer from us and is safe to call from any
    // thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Allocations of at least this size get pages of their own (`mmap`),
/// returned to the system as soon as they are freed, for a process that
/// serves many calls: a call's result and its JSON (up to twice the output
/// cap each), a table's buffers.
pub const MMAP_THRESHOLD_BYTES: usize = 256 << 10;

/// Sets the allocator up for a long-running server (`rvisor serve`, `mcp`,
/// `session --jsonl` call it first): allocations of
/// [`MMAP_THRESHOLD_BYTES`] or more are mapped apart, so their memory goes
/// back when they are freed. By default glibc raises that threshold to the
/// largest block freed so far (up to 32 MiB), after which the results of
/// large calls come from the heap, which keeps them. Measured here (a
/// debug build idle at 29 MiB, six SSE clients that never read, each call
/// printing to the 8 MiB output cap, then the clients leave, two rounds):
/// 170 and 204 MiB after the rounds with neither this nor the trim after
/// large streams ([`give_back`]), 114 and 149 MiB with the trim alone, 44
/// and 49 MiB with this alone, 33 and 34 MiB with both. A process-wide
/// setting, so it is the program's choice, never the library's.
pub fn tune_for_serving() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets one of the allocator's parameters under
    // its lock; it takes no pointer and is safe to call from any thread.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES as libc::c_int);
    }
}
