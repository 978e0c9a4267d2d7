//! Rich results at their bounds and in the REPL, against real R: SVG
//! pages counted against the call's output cap like PNG pages (a page
//! that does not fit is dropped and the result says so), the page count
//! kept at `bounds::MAX_PLOTS`, and `rvisor repl` saving the displays of
//! each call next to its plots, numbered on across calls.

use rvisor::{CallOptions, DisplayOptions, Outcome, PlotFormat};
use rvisor_ffi_tests::{worker, TestDir};
use rvisor_protocol::bounds;
use std::io::Write;
use std::process::{Command, Stdio};

fn format(f: PlotFormat, max_output_bytes: u64) -> CallOptions {
    CallOptions {
        max_output_bytes,
        display: DisplayOptions {
            plot_format: Some(f),
            ..DisplayOptions::default()
        },
        ..CallOptions::default()
    }
}

/// A small page, then one of 20,000 points (its SVG is megabytes).
const SMALL_THEN_BIG: &str = "plot(1:5); plot(rnorm(20000))";

#[test]
fn an_svg_page_over_the_output_cap_is_dropped_and_the_result_says_so() {
    let mut w = worker();
    // With room for everything, both pages come back; the second is big.
    let roomy = w.run(SMALL_THEN_BIG, &format(PlotFormat::Svg, 64 << 20));
    assert_eq!(roomy.outcome, Outcome::Complete, "{}", roomy.console);
    assert_eq!(roomy.plots.len(), 2);
    let small = roomy.plots[0].data_base64.len() as u64;
    let big = roomy.plots[1].data_base64.len() as u64;
    assert!(big > 10 * small, "small {small} bytes, big {big} bytes");
    // A cap between the two keeps the first page only.
    let cap = (small + big) / 4;
    assert!(cap > small && cap < big, "cap {cap}");
    let r = w.run(SMALL_THEN_BIG, &format(PlotFormat::Svg, cap));
    assert_eq!(r.outcome, Outcome::OutputTruncated, "{}", r.console);
    assert!(r.truncated);
    assert!(
        r.truncated_fields.iter().any(|f| f == "plots"),
        "{:?}",
        r.truncated_fields
    );
    assert_eq!(r.plots.len(), 1, "only the page that fits");
    assert_eq!(r.plots[0].mime, "image/svg+xml");
    // The small page (its SVG differs from run to run only in ids).
    let kept = r.plots[0].data_base64.len() as u64;
    assert!(kept < cap && kept * 2 < big, "{kept} bytes kept");
    // Its display carries the same SVG, and nothing of the dropped page.
    assert_eq!(r.displays.len(), 1, "{:?}", r.displays);
    let svg = r.displays[0].data["image/svg+xml"].as_str().unwrap();
    assert!(svg.contains("<svg"), "{}", &svg[..svg.len().min(200)]);
    assert!((svg.len() as u64) < cap);
    // The session goes on, and the next call has its whole cap again.
    let next = w.run(SMALL_THEN_BIG, &format(PlotFormat::Svg, 64 << 20));
    assert_eq!(next.plots.len(), 2);
}

#[test]
fn with_both_formats_an_svg_that_does_not_fit_leaves_its_page_as_png() {
    let mut w = worker();
    let roomy = w.run(SMALL_THEN_BIG, &format(PlotFormat::Both, 64 << 20));
    assert_eq!(roomy.outcome, Outcome::Complete, "{}", roomy.console);
    assert_eq!(roomy.displays.len(), 2);
    let png: u64 = roomy.plots.iter().map(|p| p.data_base64.len() as u64).sum();
    let svg_big = roomy.displays[1].data["image/svg+xml"]
        .as_str()
        .unwrap()
        .len() as u64;
    assert!(svg_big > 2 * png, "PNG {png} bytes, SVG {svg_big} bytes");
    // Room for the PNG pages and the small SVG, not for the big SVG.
    let cap = png * 2 + svg_big / 4;
    assert!(cap < svg_big, "cap {cap}");
    let r = w.run(SMALL_THEN_BIG, &format(PlotFormat::Both, cap));
    assert_eq!(
        r.plots.len(),
        2,
        "both PNG pages fit: {:?}",
        r.truncated_fields
    );
    assert!(r.plots.iter().all(|p| p.mime == "image/png"));
    assert_eq!(r.displays.len(), 2);
    assert!(r.displays[0].data.contains_key("image/svg+xml"));
    assert!(r.displays[1].data.contains_key("image/png"));
    assert!(
        !r.displays[1].data.contains_key("image/svg+xml"),
        "the big SVG was over the cap"
    );
    // Its metadata says why.
    let why = r.displays[1].metadata["rvisor"]["truncated"]["image/svg+xml"]
        .as_str()
        .unwrap_or_else(|| panic!("a note: {:?}", r.displays[1].metadata));
    assert!(why.contains("max_output_bytes"), "{why}");
    assert!(r.displays[0].metadata["rvisor"].get("truncated").is_none());
    assert!(r.truncated, "{:?}", r.truncated_fields);
}

#[test]
fn svg_pages_past_the_page_limit_are_not_kept_and_the_console_says_how_many() {
    let mut w = worker();
    let n = bounds::MAX_PLOTS + 6;
    let r = w.run(
        &format!("for (i in 1:{n}) plot(i)"),
        &format(PlotFormat::Svg, 64 << 20),
    );
    assert_eq!(r.outcome, Outcome::OutputTruncated, "{}", r.console);
    assert_eq!(r.plots.len(), bounds::MAX_PLOTS);
    assert!(r.plots.iter().all(|p| p.mime == "image/svg+xml"));
    assert_eq!(r.displays.len(), bounds::MAX_PLOTS);
    assert!(
        r.console.contains("6 more plot pages were not kept"),
        "{}",
        r.console
    );
    assert!(r.truncated_fields.iter().any(|f| f == "plots"));
}

/// Feeds `input` to `rvisor repl` (no terminal: one line per line) and
/// returns its stderr, where it reports what it saved.
fn repl(dir: &std::path::Path, out: &std::path::Path, input: &str) -> String {
    let mut child = Command::new(rvisor_ffi_tests::rvisor_bin())
        .arg("--unconfined")
        .arg("repl")
        .arg("--plots-dir")
        .arg(out)
        .current_dir(dir)
        .env("HOME", dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("rvisor repl");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    // The table's text is printed as at R's prompt.
    assert!(stdout.contains("Mazda RX4"), "{stdout}");
    stderr
}

#[test]
fn the_repl_prints_text_and_saves_each_display_next_to_the_plots() {
    let dir = TestDir::new("rvisor-repl-displays");
    let out = dir.path().join("out");
    let stderr = repl(
        dir.path(),
        &out,
        "head(mtcars, 3)\nhtmltools::tags$b('bold')\nplot(1:3)\nhead(mtcars, 2)\n",
    );
    // The HTML value's text line is printed; every file's path too.
    assert!(stderr.contains("shown as HTML"), "{stderr}");
    for f in [
        "display-001.html",
        "display-001.md",
        "display-001.json",
        "display-002.html",
        "plot-001.png",
        // The last table, after a plot: numbering goes on across calls.
        "display-003.html",
        "display-003.md",
        "display-003.json",
    ] {
        let path = out.join(f);
        assert!(path.exists(), "{f} missing; {stderr}");
        assert!(
            stderr.contains(&format!("saved to {}", path.display())),
            "{f} not reported; {stderr}"
        );
    }
    let html = std::fs::read_to_string(out.join("display-001.html")).unwrap();
    assert!(
        html.contains("Mazda RX4") && html.contains("<table"),
        "{html}"
    );
    let widget = std::fs::read_to_string(out.join("display-002.html")).unwrap();
    assert!(widget.contains("<b>bold</b>"), "{widget}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("display-003.json")).unwrap())
            .unwrap();
    assert_eq!(json["nrow"], 2);
    assert_eq!(json["rows"].as_array().unwrap().len(), 2);
    let png = std::fs::read(out.join("plot-001.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}
