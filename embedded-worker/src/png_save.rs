//! `R_SaveAsPng`, exported from the worker's executable.
//!
//! cairo.so (R's cairo bitmap devices) calls `R_SaveAsPng` through its
//! PLT, so a definition in this executable's dynamic symbol table (the link
//! argument in `build.rs` puts it there) is the one the dynamic linker
//! binds when grDevices loads cairo.so: every PNG page (the call's plots, a
//! user's own `png()`) is written by `rvisor-png` (png/src/lib.rs: why,
//! and how it matches R's writer) rather than by R's `rbitmap.c`.

use std::os::raw::{c_int, c_uint, c_void};

/// R's `R_SaveAsPng()`: same arguments, same result.
///
/// # Safety
///
/// Called by R's device code with `d` and `gp` describing a
/// `width` x `height` image and `fp` open for writing, as R's own is.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn R_SaveAsPng(
    d: *mut c_void,
    width: c_int,
    height: c_int,
    gp: Option<rvisor_png::GetPixel>,
    bgr: c_int,
    fp: *mut libc::FILE,
    transparent: c_uint,
    res: c_int,
) -> c_int {
    // SAFETY: R's device passes its image, reader and open file as the
    // contract of save_as_png asks (this function's own contract).
    unsafe { rvisor_png::save_as_png(d, width, height, gp, bgr, fp, transparent, res) }
}
