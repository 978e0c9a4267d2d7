//! The PNG writer of the rvisor worker's R bitmap devices.
//!
//! R's cairo bitmap device (`png(type = "cairo")`, the device every call's
//! plots are drawn on, and the one a user's own `png()` opens) ends each
//! page with `R_SaveAsPng()` from R's `rbitmap.c`. That function asks for
//! every pixel through a callback twice, binary-searches a palette for
//! each, and compresses with libpng's defaults: for a 1000x650 page it took
//! about 8 ms of a base plot's 17 (perf: more than half of a loop of
//! `png(); plot(1:10); dev.off()`), more than drawing the plot.
//!
//! [`save_as_png`] takes the same arguments and writes the same image: a
//! palette PNG when the page has at most 256 colours (the palette and its
//! transparency as R builds them), else RGB, or RGBA with the alpha
//! un-premultiplied as R does; the resolution as a `pHYs` chunk. It reads
//! each pixel once for a first look and once to encode, keeps runs of one
//! colour off the palette search, and compresses with `fdeflate` (the
//! `png` crate's `Compression::Fast`) after the adaptive filter.
//!
//! One difference, on purpose: R decides whether the page has transparent
//! pixels only among the pixels it scanned before it found a 257th colour,
//! so a page with many colours before its first transparent pixel lost its
//! alpha; this looks at every pixel.
//!
//! The worker (`embedded-worker/src/png_save.rs`) exports `R_SaveAsPng`,
//! which calls this; the crate is its own so that it is built optimised in
//! the debug profile the tests and the instruction-count guard use
//! (Cargo.toml), where the worker's own code is not.
//!
//! Test: `ffi-tests` `plots.rs` `pngs_from_the_faster_writer_decode_to_cairos_pixels`.

use std::os::raw::{c_int, c_uint, c_void};

/// The pixel callback R passes: the colour of pixel (row, column).
pub type GetPixel = unsafe extern "C" fn(*mut c_void, c_int, c_int) -> c_uint;

/// Above this many bytes the image is encoded a row at a time rather than
/// from one buffer (a poster-sized `png()` must not need twice its
/// surface's memory).
const WHOLE_IMAGE_MAX: usize = 64 << 20;

/// How a pixel's channels are laid out (`bgr` of R's call).
#[derive(Clone, Copy, Debug)]
struct Layout {
    r_shift: u32,
    b_shift: u32,
}

impl Layout {
    fn new(bgr: bool) -> Self {
        if bgr {
            Layout {
                r_shift: 0,
                b_shift: 16,
            }
        } else {
            Layout {
                r_shift: 16,
                b_shift: 0,
            }
        }
    }
    fn rgb(self, col: u32) -> [u8; 3] {
        [
            (col >> self.r_shift) as u8,
            (col >> 8) as u8,
            (col >> self.b_shift) as u8,
        ]
    }
    /// The colour with its premultiplied alpha taken out, as R's writer
    /// does it (`0.49 + 255 * c / a`, truncated).
    fn straight(self, col: u32) -> [u8; 4] {
        let a = (col >> 24) as u8;
        let [r, g, b] = self.rgb(col);
        if a == 255 || a == 0 {
            return [r, g, b, a];
        }
        let un = |c: u8| (0.49 + 255.0 * f64::from(c) / f64::from(a)) as u8;
        [un(r), un(g), un(b), a]
    }
}

/// What a first look at every pixel found.
#[derive(Debug)]
struct Scan {
    /// The distinct colours, sorted, when there are at most 256.
    palette: Option<Vec<u32>>,
    have_alpha: bool,
}

/// The image as R's device holds it, read through its callback.
struct Source {
    d: *mut c_void,
    gp: GetPixel,
    width: usize,
    height: usize,
}

impl Source {
    fn row(&self, i: usize, out: &mut [u32]) {
        for (j, px) in out.iter_mut().enumerate() {
            // SAFETY: R's device passed `d` and `gp` together for an image of
            // `width` x `height` pixels, and is blocked in this call while we
            // read; `i` < height and `j` < width, which fit in c_int because
            // R passed them as c_int.
            *px = unsafe { (self.gp)(self.d, i as c_int, j as c_int) };
        }
    }

    fn scan(&self, transparent: u32) -> Scan {
        let mut palette: Vec<u32> = Vec::with_capacity(256);
        if transparent != 0 {
            palette.push(transparent & 0xFF_FFFF);
        }
        let mut fits = true;
        let mut have_alpha = false;
        let mut row = vec![0u32; self.width];
        let mut last: Option<u32> = None;
        for i in 0..self.height {
            self.row(i, &mut row);
            for &col in &row {
                if last == Some(col) {
                    continue;
                }
                last = Some(col);
                if col >> 24 < 255 {
                    have_alpha = true;
                }
                if fits {
                    if let Err(at) = palette.binary_search(&col) {
                        if palette.len() >= 256 {
                            fits = false;
                        } else {
                            palette.insert(at, col);
                        }
                    }
                }
            }
            if !fits && have_alpha {
                break;
            }
        }
        Scan {
            palette: fits.then_some(palette),
            have_alpha: have_alpha && transparent == 0,
        }
    }
}

/// The PNG's header chunks as R's writer sets them.
fn header<W: std::io::Write>(
    w: W,
    width: u32,
    height: u32,
    scan: &Scan,
    layout: Layout,
    transparent: u32,
    res: c_int,
) -> png::Encoder<'static, W> {
    let mut enc = png::Encoder::new(w, width, height);
    enc.set_depth(png::BitDepth::Eight);
    // fdeflate codes runs of zero bytes, which the adaptive filter makes
    // of a plot's flat areas: on plots of 1000x650, 0.2-1.6 ms against
    // 3-20 ms for zlib's level 6, and files 1.1-1.5x the size of R's.
    enc.set_compression(png::Compression::Fast);
    enc.set_filter(png::Filter::Adaptive);
    match &scan.palette {
        Some(pal) => {
            enc.set_color(png::ColorType::Indexed);
            let mut plte = Vec::with_capacity(pal.len() * 3);
            let mut trns = Vec::with_capacity(pal.len());
            for &col in pal {
                if transparent != 0 {
                    plte.extend_from_slice(&layout.rgb(col));
                    trns.push(if col == transparent { 0 } else { 255 });
                } else {
                    let px = layout.straight(col);
                    plte.extend_from_slice(&px[..3]);
                    trns.push(px[3]);
                }
            }
            enc.set_palette(plte);
            if transparent != 0 || scan.have_alpha {
                enc.set_trns(trns);
            }
        }
        None => {
            enc.set_color(if scan.have_alpha {
                png::ColorType::Rgba
            } else {
                png::ColorType::Rgb
            });
            if transparent != 0 {
                // The colour that is transparent, as 16-bit samples.
                let [r, g, b] = layout.rgb(transparent);
                enc.set_trns(vec![0, r, 0, g, 0, b]);
            }
        }
    }
    if res > 0 {
        let ppm = (f64::from(res) / 0.0254) as u32;
        enc.set_pixel_dims(Some(png::PixelDimensions {
            xppu: ppm,
            yppu: ppm,
            unit: png::Unit::Meter,
        }));
    }
    enc
}

/// One row of the output from one row of pixels.
fn encode_row(
    row: &[u32],
    scan: &Scan,
    layout: Layout,
    last: &mut Option<(u32, u8)>,
    out: &mut Vec<u8>,
) {
    match &scan.palette {
        Some(pal) => {
            for &col in row {
                let idx = match *last {
                    Some((c, i)) if c == col => i,
                    _ => {
                        // Every colour of the image is in the palette (scan()).
                        let i = pal.binary_search(&col).unwrap_or(0) as u8;
                        *last = Some((col, i));
                        i
                    }
                };
                out.push(idx);
            }
        }
        None if scan.have_alpha => {
            for &col in row {
                out.extend_from_slice(&layout.straight(col));
            }
        }
        None => {
            for &col in row {
                out.extend_from_slice(&layout.rgb(col));
            }
        }
    }
}

/// Writes the image to `out`; `Err` on a failed write.
fn save(
    src: &Source,
    layout: Layout,
    transparent: u32,
    res: c_int,
    out: impl std::io::Write,
) -> Result<(), png::EncodingError> {
    let scan = src.scan(transparent);
    let bpp = match (&scan.palette, scan.have_alpha) {
        (Some(_), _) => 1,
        (None, true) => 4,
        (None, false) => 3,
    };
    let enc = header(
        out,
        src.width as u32,
        src.height as u32,
        &scan,
        layout,
        transparent,
        res,
    );
    let mut writer = enc.write_header()?;
    let mut row = vec![0u32; src.width];
    let mut last = None;
    let total = src.width.saturating_mul(src.height).saturating_mul(bpp);
    if total <= WHOLE_IMAGE_MAX {
        let mut data = Vec::with_capacity(total);
        for i in 0..src.height {
            src.row(i, &mut row);
            encode_row(&row, &scan, layout, &mut last, &mut data);
        }
        writer.write_image_data(&data)?;
        writer.finish()
    } else {
        let mut stream = writer.stream_writer()?;
        let mut line = Vec::with_capacity(src.width * bpp);
        for i in 0..src.height {
            src.row(i, &mut row);
            line.clear();
            encode_row(&row, &scan, layout, &mut last, &mut line);
            std::io::Write::write_all(&mut stream, &line)?;
        }
        stream.finish()
    }
}

/// Writes to a C `FILE*` (R opened it and closes it after this returns).
struct CFile(*mut libc::FILE);

impl std::io::Write for CFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // SAFETY: self.0 is the non-null FILE* R passed, open for writing
        // for the whole of R_SaveAsPng; buf is a valid slice.
        let n = unsafe { libc::fwrite(buf.as_ptr().cast(), 1, buf.len(), self.0) };
        if n == 0 && !buf.is_empty() {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Writes the `width` x `height` image that `gp` reads from `d` to `fp`
/// as a PNG, with R's `R_SaveAsPng()`'s arguments and result (1 when
/// written, 0 when not).
///
/// # Safety
///
/// `d` and `gp` describe a `width` x `height` image that `gp` can read at
/// every (row, column) inside it while this runs, and `fp` is a C `FILE*`
/// open for writing (or null), as R's device code passes them.
#[allow(clippy::too_many_arguments)]
pub unsafe fn save_as_png(
    d: *mut c_void,
    width: c_int,
    height: c_int,
    gp: Option<GetPixel>,
    bgr: c_int,
    fp: *mut libc::FILE,
    transparent: c_uint,
    res: c_int,
) -> c_int {
    let (Some(gp), false, Ok(w), Ok(h)) = (
        gp,
        fp.is_null(),
        usize::try_from(width),
        usize::try_from(height),
    ) else {
        return 0;
    };
    if w == 0 || h == 0 {
        return 0;
    }
    let src = Source {
        d,
        gp,
        width: w,
        height: h,
    };
    let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        save(&src, Layout::new(bgr != 0), transparent, res, CFile(fp)).is_ok()
    }));
    c_int::from(matches!(done, Ok(true)))
}
