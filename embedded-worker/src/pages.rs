//! Plot pages read as soon as they are finished, so a page drawn early in
//! a long call reaches a streaming client (a Jupyter cell's output) while
//! the call still runs, in order with the text around it, rather than when
//! the call ends.
//!
//! A page is finished when the next one starts: the driver's page hook
//! names the finished page's file (`plot_page`), which the device writes
//! right after the hook returns, inside the same `plot.new()`. The file is
//! read at the next point where R is not inside that call: the next
//! console text, the next report of the driver, R's event poll (loops,
//! `Sys.sleep()`), or the call's end. Reading it there is safe: the device
//! writes on the R thread, which is the one reading, and it writes a
//! page's file whole when the page ends (the file it makes when a page
//! begins is empty until then, and is left alone). The page then gets
//! its place in the console's segments, and its display (when the call
//! has displays) is streamed with its bundle. Pages the call's end finds
//! are read as before (the last page, and every page when a call asks for
//! both PNG and SVG, whose SVG is drawn only at the end).

use crate::{console, display};
use base64::Engine;
use rvisor_protocol::{Plot, Segment};
use std::cell::RefCell;

#[derive(Debug, Default)]
struct Pages {
    /// Pages are read as they finish in this call.
    on: bool,
    /// The call has displays: a page read gets its display.
    rich: bool,
    width: u32,
    height: u32,
    /// Finished pages' files, in order, not read yet.
    pending: Vec<String>,
    /// The pages read, in order: the first of the call's plots.
    read: Vec<Plot>,
}

thread_local! {
    static PAGES: RefCell<Pages> = RefCell::new(Pages::default());
}

/// A new call: pages are read as they finish when `on` (PNG alone or SVG
/// alone), with a display each when `rich`.
pub fn begin(on: bool, rich: bool, width: u32, height: u32) {
    crate::due::clear();
    PAGES.with(|p| {
        *p.borrow_mut() = Pages {
            on,
            rich,
            width,
            height,
            ..Pages::default()
        }
    });
}

/// The driver finished a page whose file is `file` (written once the
/// page hook returns).
pub fn finished(file: Option<String>) {
    let Some(file) = file else { return };
    PAGES.with(|p| {
        if let Ok(mut p) = p.try_borrow_mut() {
            if p.on {
                p.pending.push(file);
                crate::due::arm(settle);
            }
        }
    });
}

/// Reads the finished pages whose files are written, in order: each takes
/// its place among the console's segments, and its display is made and
/// streamed. While a page is pending, the console's writes and R's event
/// poll run it (through [`crate::due`]).
pub fn settle() {
    loop {
        // One page at a time, the borrow released before the console and
        // the displays are touched.
        let next = PAGES.with(|p| {
            let mut p = p.try_borrow_mut().ok()?;
            let Some(file) = p.pending.first() else {
                crate::due::clear();
                return None;
            };
            // The device makes a page's file, empty, when the page begins
            // and writes it whole when the page ends: only a file with
            // bytes is a finished page. An empty one is still being drawn
            // on (a page of several panels, `par(mfrow)`, runs the page
            // hook for each panel), a missing one is not begun: both wait
            // (at worst until the call's end reads what is left).
            if std::fs::metadata(file).map_or(true, |m| m.len() == 0) {
                return None;
            }
            let file = p.pending.remove(0);
            Some((file, p.width, p.height, p.rich))
        });
        let Some((file, width, height, rich)) = next else {
            return;
        };
        let Some(plot) = read_page(&file, width, height) else {
            continue;
        };
        let index = PAGES.with(|p| {
            let mut p = p.borrow_mut();
            p.read.push(plot.clone());
            p.read.len() - 1
        });
        console::push_unstreamed(Segment::Plot { index });
        if rich {
            display::push_page(display::of_plot(index, &plot, None));
        }
    }
}

/// The pages read during the call (after a last [`settle`]); the next
/// pages the call's end reads follow them.
pub fn take() -> Vec<Plot> {
    settle();
    PAGES.with(|p| {
        let mut p = p.borrow_mut();
        p.pending.clear();
        crate::due::clear();
        std::mem::take(&mut p.read)
    })
}

/// Reads plot file `f` (PNG, or SVG) and deletes it; `None` when it is
/// missing or empty, or does not fit under the call's output cap (then it
/// is never loaded, and the capture is marked cut).
pub fn read_page(f: &str, width: u32, height: u32) -> Option<Plot> {
    let size = std::fs::metadata(f).map(|m| m.len()).unwrap_or(0);
    if size == 0 || !console::admit_bytes(size) {
        let _ = std::fs::remove_file(f);
        return None;
    }
    let data = std::fs::read(f);
    let _ = std::fs::remove_file(f);
    let data = data.ok().filter(|d| !d.is_empty())?;
    let svg = f.ends_with(".svg");
    Some(Plot {
        mime: if svg { "image/svg+xml" } else { "image/png" }.into(),
        width,
        height,
        data_base64: base64::engine::general_purpose::STANDARD.encode(&data),
    })
}
