//! Plots captured as PNG: lazily, one file per page, sized per call, across
//! base graphics, grid and ggplot2, continuing across calls.

use base64::Engine;
use rvisor::{CallOptions, Outcome, RunResult, Segment};
use rvisor_ffi_tests::{run, worker};

fn png_size(data_base64: &str) -> (u32, u32) {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data_base64)
        .unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    (w, h)
}

fn plot_segments(r: &RunResult) -> Vec<usize> {
    r.segments
        .iter()
        .filter_map(|s| match s {
            Segment::Plot { index } => Some(*index),
            _ => None,
        })
        .collect()
}

#[test]
fn no_plot_means_no_png_and_no_device() {
    let mut w = worker();
    let r = run(&mut w, "x <- 1:10; sum(x)");
    assert!(r.plots.is_empty());
    assert_eq!(
        run(&mut w, "dev.cur()").console,
        "null device \n          1 \n"
    );
}

#[test]
fn base_plot_default_size() {
    let mut w = worker();
    let r = run(&mut w, "plot(1:10)");
    assert_eq!(r.outcome, Outcome::Complete);
    assert_eq!(r.plots.len(), 1);
    let p = &r.plots[0];
    assert_eq!(
        (p.mime.as_str(), p.width, p.height),
        ("image/png", 1000, 650)
    );
    assert_eq!(png_size(&p.data_base64), (1000, 650));
    assert_eq!(plot_segments(&r), vec![0]);
    // The device is closed after the call.
    assert_eq!(
        run(&mut w, "dev.cur()").console,
        "null device \n          1 \n"
    );
}

#[test]
fn two_plots_in_one_call_give_two_pngs_with_the_requested_size() {
    let mut w = worker();
    let opts = CallOptions {
        plot_width: 400,
        plot_height: 300,
        ..CallOptions::default()
    };
    let r = w.run("plot(1:3); hist(rnorm(100))", &opts);
    assert_eq!(r.plots.len(), 2);
    for p in &r.plots {
        assert_eq!(png_size(&p.data_base64), (400, 300));
    }
    assert_eq!(plot_segments(&r), vec![0, 1]);
    assert_ne!(r.plots[0].data_base64, r.plots[1].data_base64);
}

#[test]
fn plot_size_out_of_range_is_rejected() {
    let mut w = worker();
    let opts = CallOptions {
        plot_width: 5000,
        ..CallOptions::default()
    };
    let r = w.run("plot(1)", &opts);
    assert_eq!(r.outcome, Outcome::Rejected);
    assert!(r.error.unwrap().message.contains("4096"));
}

#[test]
fn grid_and_ggplot2() {
    let mut w = worker();
    let r = run(
        &mut w,
        "grid::grid.newpage(); grid::grid.rect(); grid::grid.text('hi')",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.plots.len(), 1);
    let r = run(
        &mut w,
        "library(ggplot2); p <- ggplot(mtcars, aes(wt, mpg)) + geom_point(); p; print(p + geom_smooth(method = 'lm', formula = y ~ x))",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.plots.len(), 2);
}

#[test]
fn low_level_drawing_in_a_later_call_continues_the_previous_plot() {
    let mut w = worker();
    let r1 = run(&mut w, "plot(1:10)");
    assert_eq!(r1.plots.len(), 1);
    // lines() in the next call draws on the previous plot, as at the R prompt,
    // and the call returns the updated page.
    let r2 = run(&mut w, "lines(1:10, col = 'red'); abline(h = 5)");
    assert_eq!(r2.outcome, Outcome::Complete, "{}", r2.console);
    assert_eq!(r2.plots.len(), 1);
    assert_ne!(r2.plots[0].data_base64, r1.plots[0].data_base64);
    // A new high-level plot starts a fresh page: the old one is not repeated.
    let r3 = run(&mut w, "plot(10:1)");
    assert_eq!(r3.plots.len(), 1);
    // A call that only queries the device does not re-send the old plot.
    let r4 = run(&mut w, "invisible(par('usr'))");
    assert!(r4.plots.is_empty(), "{} plots", r4.plots.len());
    // After dev.off() there is nothing to continue.
    run(&mut w, "plot(1); dev.off()");
    let r5 = run(&mut w, "lines(1:2)");
    assert_eq!(r5.outcome, Outcome::Error);
    assert!(r5
        .error
        .unwrap()
        .message
        .contains("plot.new has not been called yet"));
}

#[test]
fn plots_count_against_the_output_cap() {
    let mut w = worker();
    let opts = CallOptions {
        max_output_bytes: 2_000,
        ..CallOptions::default()
    };
    let r = w.run("plot(rnorm(1000))", &opts);
    assert!(r.plots.is_empty());
    assert!(r.truncated);
    assert_eq!(r.outcome, Outcome::OutputTruncated);
}

#[test]
fn user_devices_are_left_alone() {
    let mut w = worker();
    let f = std::env::temp_dir().join(format!("rvisor-user-{}.png", rvisor::ids::random_hex(4)));
    let code = format!("png('{}'); plot(1); invisible(dev.off())", f.display());
    let r = run(&mut w, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(r.plots.is_empty());
    assert!(f.exists());
    let _ = std::fs::remove_file(f);
}

/// A PNG file's pixels as RGBA (palettes and tRNS expanded), its size, its
/// resolution chunk (pixels per metre) and the first two bytes of its zlib
/// stream.
struct Decoded {
    rgba: Vec<u8>,
    size: (u32, u32),
    ppm: Option<u32>,
    zlib_header: [u8; 2],
}

fn decode(path: &std::path::Path) -> Decoded {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut dec = png::Decoder::new(std::io::Cursor::new(&bytes));
    dec.set_transformations(png::Transformations::EXPAND);
    let mut reader = dec.read_info().expect("a PNG");
    let mut buf = vec![0; reader.output_buffer_size().expect("a size")];
    let frame = reader.next_frame(&mut buf).expect("its pixels");
    let data = &buf[..frame.buffer_size()];
    let rgba = match frame.color_type {
        png::ColorType::Rgba => data.to_vec(),
        png::ColorType::Rgb => data
            .chunks(3)
            .flat_map(|p| [p[0], p[1], p[2], 255])
            .collect(),
        other => panic!("{}: unexpected colour type {other:?}", path.display()),
    };
    let ppm = reader.info().pixel_dims.map(|d| d.xppu);
    let idat = bytes
        .windows(4)
        .position(|w| w == b"IDAT")
        .expect("an IDAT chunk");
    Decoded {
        rgba,
        size: (frame.width, frame.height),
        ppm,
        zlib_header: [bytes[idat + 4], bytes[idat + 5]],
    }
}

/// The worker writes PNG pages with its own `R_SaveAsPng`
/// (embedded-worker/src/png_save.rs), which cairo.so binds in place of R's:
/// each page here is drawn twice in the worker, through `png(type =
/// "cairo")` (that writer) and `png(type = "cairo-png")` (cairo's own
/// writer, which R's device calls instead), and the two files must hold the
/// same pixels: a palette page, a page of more than 256 colours, and
/// transparent pages of both kinds (cairo rounds un-premultiplied colours
/// its own way, so colours of partly transparent pixels may differ by one).
#[test]
fn pngs_from_the_faster_writer_decode_to_cairos_pixels() {
    let mut w = worker();
    let dir = std::env::temp_dir().join(format!("rvisor-png-{}", rvisor::ids::random_hex(4)));
    std::fs::create_dir_all(&dir).unwrap();
    let pages = [
        ("palette", "", "plot(1:10, main = 'palette')"),
        ("rgb", "", "image(volcano, col = hcl.colors(500))"),
        (
            "alpha_palette",
            ", bg = 'transparent'",
            "plot(1:10, col = rgb(1, 0, 0, 0.5), pch = 19, cex = 5)",
        ),
        (
            "alpha_rgb",
            ", bg = 'transparent'",
            "image(volcano, col = hcl.colors(500, alpha = 0.7))",
        ),
    ];
    for (name, args, draw) in pages {
        let ours = dir.join(format!("{name}-ours.png"));
        let cairo = dir.join(format!("{name}-cairo.png"));
        let code = format!(
            "for (f in list(c('{}', 'cairo'), c('{}', 'cairo-png'))) {{ \
               png(f[[1]], width = 400, height = 300, type = f[[2]]{args}); {draw}; \
               invisible(dev.off()) }}",
            ours.display(),
            cairo.display()
        );
        let r = run(&mut w, &code);
        assert_eq!(r.outcome, Outcome::Complete, "{name}: {}", r.console);
        let (a, b) = (decode(&ours), decode(&cairo));
        assert_eq!(a.size, (400, 300), "{name}");
        assert_eq!(a.size, b.size, "{name}");
        // fdeflate's header (FLEVEL 0); libpng at R's default level writes
        // 78 9C or 78 DA, so this is the worker's writer, not R's.
        assert_eq!(
            a.zlib_header,
            [0x78, 0x01],
            "{name}: not the worker's writer"
        );
        let mut differ = 0;
        for (pa, pb) in a.rgba.chunks(4).zip(b.rgba.chunks(4)) {
            assert_eq!(pa[3], pb[3], "{name}: alpha differs");
            let close = pa[3] == 0
                || (0..3).all(|c| {
                    if pa[3] == 255 {
                        pa[c] == pb[c]
                    } else {
                        pa[c].abs_diff(pb[c]) <= 1
                    }
                });
            if !close {
                differ += 1;
            }
        }
        assert_eq!(differ, 0, "{name}: {differ} pixels differ from cairo's");
        if name.starts_with("alpha") {
            assert!(
                a.rgba.chunks(4).any(|p| p[3] == 0) && a.rgba.chunks(4).any(|p| p[3] == 255),
                "{name}: the page is partly transparent"
            );
        }
    }
    // The resolution goes into a pHYs chunk, as R's writer puts it.
    let f = dir.join("res.png");
    let r = run(
        &mut w,
        &format!(
            "png('{}', width = 300, height = 300, res = 150, type = 'cairo'); plot(1); invisible(dev.off())",
            f.display()
        ),
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(decode(&f).ppm, Some(5905));
    let _ = std::fs::remove_dir_all(&dir);
}
