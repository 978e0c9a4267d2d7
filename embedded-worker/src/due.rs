//! Work that is due before the next console text or event poll: a
//! finished plot page waiting to be read (see `pages`).
//!
//! The console and the event poll sit below the page reader (it writes
//! into the console's segments and the display stream), so they do not
//! call it by name: the reader arms its hook here when a page is pending,
//! and they run [`run`], a single thread-local test when nothing is due.

use std::cell::Cell;

thread_local! {
    static DUE: Cell<Option<fn()>> = const { Cell::new(None) };
}

/// `work` runs at the next console write or event poll (until [`clear`]).
pub fn arm(work: fn()) {
    DUE.with(|d| d.set(Some(work)));
}

/// Nothing is due any more.
pub fn clear() {
    DUE.with(|d| d.set(None));
}

/// Runs what is due, if anything.
pub fn run() {
    if let Some(work) = DUE.with(Cell::get) {
        work();
    }
}
