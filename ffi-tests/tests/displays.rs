//! Rich results against real R: tables as HTML, Markdown, text and a JSON
//! preview (agreeing with repr), HTML-only values as self-contained HTML
//! (a DT widget opened in headless Chromium with no network), plots as
//! PNG and SVG displays, the limits, and bad input.

use rvisor::{CallOptions, DisplayOptions, Outcome, PlotFormat, RunResult, Segment};
use rvisor_ffi_tests::{run, worker, TestDir};
use serde_json::Value;
use std::time::Duration;

fn with(display: DisplayOptions) -> CallOptions {
    CallOptions {
        display,
        ..CallOptions::default()
    }
}

fn limits(rows: u32, cols: u32) -> CallOptions {
    with(DisplayOptions {
        max_rows: Some(rows),
        max_cols: Some(cols),
        ..DisplayOptions::default()
    })
}

fn text<'a>(r: &'a RunResult, i: usize, mime: &str) -> &'a str {
    r.displays[i].data[mime]
        .as_str()
        .unwrap_or_else(|| panic!("{mime} of display {i}: {:?}", r.displays[i]))
}

fn display_segments(r: &RunResult) -> Vec<usize> {
    r.segments
        .iter()
        .filter_map(|s| match s {
            Segment::Display { index } => Some(*index),
            _ => None,
        })
        .collect()
}

/// The data frames the agreement test shows: mixed types, NA, factors,
/// dates, long strings, list columns, a tibble, a wide and long one,
/// names and row names to escape, matrices with and without dimnames.
/// Most are written by the driver's own markup (table_markup); `listcol`,
/// `cplx` and `secs` are repr's.
const FRAMES: &str = r#"
frames <- local({
  set.seed(26)
  n <- 2000
  long <- data.frame(id = seq_len(n), x = round(rnorm(n), 4),
                     s = sample(c("alpha", "b & c", "<tag>", NA, "  two  spaces"), n, TRUE),
                     f = factor(sample(c("lo", "mid", "hi", NA), n, TRUE)),
                     day = as.Date("2020-01-01") + seq_len(n),
                     t = as.POSIXct("2024-01-01 12:00:00", tz = "UTC") + seq_len(n) * 3600,
                     b = sample(c(TRUE, FALSE, NA), n, TRUE), stringsAsFactors = FALSE)
  list(
  mixed = data.frame(i = c(1L, NA, 3L), d = c(1.5, NaN, -Inf), s = c("a", NA, "<b>&"),
                     f = factor(c("u", "v", NA)), day = as.Date("2024-02-29") + 0:2,
                     t = as.POSIXct("2024-01-01 12:00:00", tz = "UTC") + 0:2,
                     b = c(TRUE, FALSE, NA), long = c(strrep("x", 300), "y", "z"),
                     stringsAsFactors = FALSE),
  listcol = local({ d <- data.frame(k = 1:3); d$l <- list(1:2, "a", list(x = 1)); d }),
  big = as.data.frame(matrix(seq_len(100 * 30), 100, 30)),
  named = data.frame(v = 1:12, row.names = sprintf("r%02d", 1:12)),
  tib = tibble::tibble(a = 1:40, b = letters[(0:39 %% 26) + 1]),
  mat = matrix(c("a", "b", NA, "d"), 2, dimnames = list(NULL, c("x", "y"))),
  long = long,
  subset = long[c(3, 7, 11, 1999), ],
  tiblong = tibble::as_tibble(long),
  escapes = setNames(data.frame(c(1.25, 3), c("x & y", "p  q"), c("<i>", ""),
                                row.names = c("a&b", "<c>  d")),
                     c("a&b", "<x>", "q\"uote")),
  blanks = setNames(data.frame(1:2, 3:4), c("two  spaces", " ")),
  onecol = data.frame(x = c(3.14159, 2.5, NA)),
  zero = data.frame(a = integer(), b = character(), c = factor()),
  tibzero = tibble::tibble(a = integer(), b = character()),
  nums = data.frame(a = c(1e-10, 1, 1e10), b = c(123456789.123, 0.1, NA), c = c(Inf, -Inf, NaN),
                    k = c(1L, 100000L, NA)),
  kinds = data.frame(o = ordered(c("lo", "hi", "lo"), levels = c("lo", "hi")),
                     f = factor(c("b&", "a", NA), levels = c("a", "b&")),
                     d = as.Date(c("2020-01-01", NA, "1999-12-31")),
                     t = as.POSIXct(c("2020-01-01", "2020-01-02", NA), tz = "UTC"),
                     u = c("\u00fcber", "\u65e5\u672c", "caf\u00e9 & cr\u00e8me"),
                     l = c(NA, NA, NA)),
  wide = as.data.frame(matrix(round(rnorm(40 * 50), 3), 40, 50)),
  matnum = matrix(c(1.5, -2, NA, 1e6, 0, 3), 3),
  matnames = matrix(1:6, 2, dimnames = list(c("r&1", "r2"), c("<a>", "b", "c"))),
  matbig = matrix(round(runif(100 * 40), 5), 100, 40,
                  dimnames = list(paste0("row", 1:100), paste0("c", 1:40))),
  matbare = matrix(1:(60 * 30), 60, 30),
  matlgl = matrix(c(TRUE, NA, FALSE, TRUE), 2, dimnames = list(c("a", "b"), NULL)),
  cplx = data.frame(z = c(1i, 2 + 3i)),
  secs = data.frame(d = as.difftime(c(1, 2), units = "secs"))
  )
})
"#;

/// Every name in FRAMES.
const FRAME_NAMES: [&str; 24] = [
    "mixed", "listcol", "big", "named", "tib", "mat", "long", "subset", "tiblong", "escapes",
    "blanks", "onecol", "zero", "tibzero", "nums", "kinds", "wide", "matnum", "matnames", "matbig",
    "matbare", "matlgl", "cplx", "secs",
];

#[test]
fn tables_agree_with_repr_for_the_same_frames_and_limits() {
    let mut w = worker();
    assert_eq!(run(&mut w, FRAMES).outcome, Outcome::Complete);
    for (rows, cols) in [(20, 20), (5, 4), (3, 7)] {
        for name in FRAME_NAMES {
            let opts = limits(rows, cols);
            let r = w.run(&format!("frames${name}"), &opts);
            assert_eq!(r.outcome, Outcome::Complete, "{name}: {}", r.console);
            assert_eq!(r.displays.len(), 1, "{name}");
            assert_eq!(display_segments(&r), vec![0]);
            // text/plain is exactly what R printed (cut at 64 KiB: the
            // 2,000-row frames print more).
            if r.console.len() < 65_536 {
                assert_eq!(text(&r, 0, "text/plain"), r.console, "{name}");
            }
            assert_eq!(r.displays[0].metadata["rvisor"]["kind"], "table", "{name}");
            for (mime, f) in [
                ("text/html", "repr_html"),
                ("text/markdown", "repr_markdown"),
            ] {
                let want = w.run(
                    &format!(
                        "local({{ op <- options(repr.matrix.max.rows = {rows}, \
                         repr.matrix.max.cols = {cols}); on.exit(options(op)); \
                         cat(repr::{f}(frames${name})) }})"
                    ),
                    &CallOptions::default(),
                );
                if want.outcome != Outcome::Complete {
                    // repr fails on a matrix cut to a corner of one row
                    // (3 rows: 2 above, 1 below): so does the display,
                    // which then has no HTML or Markdown, as before.
                    assert!(name.starts_with("mat"), "{name}: {}", want.console);
                    assert!(!r.displays[0].data.contains_key(mime), "{name} {mime}");
                    continue;
                }
                assert_eq!(
                    text(&r, 0, mime),
                    want.console,
                    "{name} {mime} {rows}x{cols}"
                );
            }
        }
    }
}

#[test]
fn plain_tables_are_shown_without_loading_repr() {
    let mut w = worker();
    let loaded = |w: &mut rvisor::Worker| {
        w.run(
            "cat(\"repr\" %in% loadedNamespaces())",
            &CallOptions::default(),
        )
        .console
    };
    let r = w.run(
        "data.frame(a = 1:30, b = c(\"x\", \"<y>\", NA), d = as.Date(\"2024-01-01\") + 0:29)",
        &limits(20, 20),
    );
    assert_eq!(r.displays.len(), 1, "{}", r.console);
    let html = text(&r, 0, "text/html");
    assert!(
        html.starts_with(
            "<table class=\"dataframe\">\n<caption>A data.frame: 30 \u{d7} 3</caption>"
        ),
        "{html}"
    );
    assert!(html.contains("<td>&lt;y&gt;</td>"), "{html}");
    assert!(text(&r, 0, "text/markdown").contains("| a &lt;int&gt; |"));
    assert_eq!(loaded(&mut w), "FALSE", "the driver wrote the table itself");
    // A list column is repr's to show.
    let r = w.run(
        "local({ d <- data.frame(k = 1:2); d$l <- list(1, \"a\"); d })",
        &limits(20, 20),
    );
    assert!(text(&r, 0, "text/html").contains("<table"));
    assert_eq!(loaded(&mut w), "TRUE");
}

#[test]
fn the_json_preview_is_typed_and_says_when_it_was_cut() {
    let mut w = worker();
    run(&mut w, FRAMES);
    let r = w.run("frames$mixed", &limits(2, 20));
    let j = &r.displays[0].data["application/json"];
    assert_eq!(j["nrow"], 3);
    assert_eq!(j["ncol"], 8);
    assert_eq!(j["truncated"], true);
    let types: Vec<&str> = j["columns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        [
            "integer",
            "numeric",
            "character",
            "factor",
            "Date",
            "POSIXct",
            "logical",
            "character"
        ]
    );
    let rows = j["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0][0], 1);
    assert_eq!(rows[1][0], Value::Null, "NA is null");
    assert_eq!(rows[1][1], Value::Null, "NaN is null");
    assert_eq!(rows[0][2], "a");
    assert_eq!(rows[0][3], "u");
    assert_eq!(rows[0][4], "2024-02-29");
    assert_eq!(rows[0][6], true);
    let long = rows[0][7].as_str().unwrap();
    assert_eq!(long.chars().count(), 256, "long strings are cut");
    assert_eq!(
        j["row_names"],
        Value::Null,
        "automatic row names are left out"
    );
    let r = w.run("frames$named", &limits(3, 20));
    let j = &r.displays[0].data["application/json"];
    assert_eq!(j["row_names"], serde_json::json!(["r01", "r02", "r03"]));
    let r = w.run("frames$listcol", &CallOptions::default());
    let j = &r.displays[0].data["application/json"];
    assert_eq!(j["columns"][1]["type"], "list");
    assert_eq!(j["rows"][0][1], "1, 2");
    assert_eq!(j["truncated"], false);
    // The preview is written by the driver, column by column: its edges.
    let r = w.run("mtcars[0, 1:2]", &CallOptions::default());
    let j = &r.displays[0].data["application/json"];
    assert_eq!(j["nrow"], 0);
    assert_eq!(j["rows"], serde_json::json!([]));
    assert_eq!(j["columns"][1]["name"], "cyl");
    let r = w.run(
        r#"data.frame(x = c(1e300, -0.1, 1/3), s = c("q\"uote", "a\\b", "tab\tnew\nline"),
                      row.names = c("one", "two", "three"))[1, , drop = FALSE]"#,
        &CallOptions::default(),
    );
    let j = &r.displays[0].data["application/json"];
    assert_eq!(
        j["row_names"],
        serde_json::json!(["one"]),
        "one name is still a list"
    );
    assert_eq!(j["rows"][0][0].as_f64(), Some(1e300));
    assert_eq!(j["rows"][0][1], "q\"uote");
    let r = w.run(
        r#"data.frame(x = c(-0.1, 1/3), s = c("a\\b", "tab\tnew\nline"))"#,
        &CallOptions::default(),
    );
    let j = &r.displays[0].data["application/json"];
    assert_eq!(j["rows"][0][0].as_f64(), Some(-0.1));
    assert_eq!(j["rows"][1][0].as_f64(), Some(0.333333333333333));
    assert_eq!(j["rows"][0][1], "a\\b");
    assert_eq!(j["rows"][1][1], "tab\tnew\nline");
}

#[test]
fn plain_values_make_no_displays_and_displays_can_be_turned_off() {
    let mut w = worker();
    let r = run(&mut w, "1 + 1");
    assert!(r.displays.is_empty());
    let v = serde_json::to_value(&r).unwrap();
    assert!(v.get("displays").is_none(), "absent when empty");
    let r = run(&mut w, "x <- data.frame(a = 1:3); print(x); invisible(x)");
    assert!(
        r.displays.is_empty(),
        "print() is text; only visible values display"
    );
    let off = with(DisplayOptions {
        enabled: Some(false),
        ..DisplayOptions::default()
    });
    let r = w.run("data.frame(a = 1:3)", &off);
    assert!(r.displays.is_empty());
    assert_eq!(r.console, "  a\n1 1\n2 2\n3 3\n");
    let r = w.run("htmltools::tags$b('hi')", &off);
    assert_eq!(r.outcome, Outcome::UnsupportedOutput, "as before displays");
    let r = w.run("plot(1:3)", &off);
    assert_eq!(r.plots.len(), 1);
    assert!(r.displays.is_empty());
}

#[test]
fn rvisor_display_shows_a_value_where_it_is_called() {
    let mut w = worker();
    let r = run(
        &mut w,
        "f <- function() { rvisor_display(head(mtcars, 2)); cat('after\\n'); 1 }; y <- f()",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.displays.len(), 1);
    assert!(text(&r, 0, "text/html").contains("Mazda RX4"));
    assert!(r.console.ends_with("after\n"), "{}", r.console);
    let kinds: Vec<&str> = r
        .segments
        .iter()
        .map(|s| match s {
            Segment::Stdout { .. } => "stdout",
            Segment::Display { .. } => "display",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["stdout", "display", "stdout"]);
    assert!(text(&r, 0, "text/plain").contains("Mazda RX4"));
}

/// Decodes an 8-bit RGB(A) PNG with Python's zlib (no image library here)
/// and counts its distinct colours.
fn distinct_colours(png: &std::path::Path) -> usize {
    let script = r#"
import sys, zlib, struct
d = open(sys.argv[1], 'rb').read()
assert d[:8] == b'\x89PNG\r\n\x1a\n'
pos, idat, w, h, ct = 8, b'', 0, 0, 0
while pos < len(d):
    n, kind = struct.unpack('>I4s', d[pos:pos+8]); body = d[pos+8:pos+8+n]; pos += 12 + n
    if kind == b'IHDR':
        w, h, depth, ct = struct.unpack('>IIBB', body[:10]); assert depth == 8
    elif kind == b'IDAT':
        idat += body
bpp = {2: 3, 6: 4}[ct]
raw = zlib.decompress(idat); stride = w * bpp; prev = bytearray(stride); colours = set(); i = 0
for y in range(h):
    f = raw[i]; line = bytearray(raw[i+1:i+1+stride]); i += 1 + stride
    for x in range(stride):
        a = line[x-bpp] if x >= bpp else 0; b = prev[x]; c = prev[x-bpp] if x >= bpp else 0
        if f == 1: line[x] = (line[x] + a) & 255
        elif f == 2: line[x] = (line[x] + b) & 255
        elif f == 3: line[x] = (line[x] + (a + b) // 2) & 255
        elif f == 4:
            p = a + b - c; pa, pb, pc = abs(p-a), abs(p-b), abs(p-c)
            line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    prev = line
    for x in range(0, stride, bpp): colours.add(bytes(line[x:x+3]))
print(len(colours))
"#;
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(png)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// Headless Chromium with the network cut off (a proxy that refuses, every
/// host unresolvable): what it can show comes from the file alone.
fn chromium(args: &[&str], url: &str) -> std::process::Output {
    let profile = TestDir::new("rvisor-chromium");
    let mut cmd = std::process::Command::new("chromium");
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--proxy-server=127.0.0.1:9",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--virtual-time-budget=5000",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .args(args)
    .arg(url);
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("chromium is installed (scripts/setup.sh)");
    let pid = child.id();
    // Bounded: a browser that hangs is killed, and the test says so.
    let guard = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(90));
        // SAFETY: kill(2) of the child this test started; harmless if it
        // already exited (the pid is not reused while we hold the child).
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    });
    let out = child.wait_with_output().expect("chromium ends");
    drop(guard);
    out
}

#[test]
fn a_dt_widget_is_self_contained_html_that_renders_offline_in_chromium() {
    let mut w = worker();
    let r = run(&mut w, "DT::datatable(head(iris, 20))");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.displays.len(), 1);
    let d = &r.displays[0];
    assert_eq!(d.metadata["rvisor"]["kind"], "html");
    assert_eq!(d.metadata["rvisor"]["class"], "datatables");
    assert!(text(&r, 0, "text/plain").contains("htmlwidget (datatables)"));
    let html = text(&r, 0, "text/html");
    assert!(html.starts_with("<!doctype html>"));
    assert!(html.contains("src=\"data:application/javascript;base64,"));
    // Nothing is fetched: no script or stylesheet by URL or by file.
    for bad in ["src=\"http", "href=\"http", "src=\"lib/", "src=\"www/"] {
        assert!(!html.contains(bad), "{bad}");
    }
    let dir = TestDir::new("rvisor-dt");
    let page = dir.path().join("dt.html");
    std::fs::write(&page, html).unwrap();
    let url = format!("file://{}", page.display());
    // The scripts ran: DataTables built its wrapper around the table.
    let dom = chromium(&["--dump-dom"], &url);
    let dom = String::from_utf8_lossy(&dom.stdout);
    assert!(dom.contains("dataTables_wrapper"), "DT did not run offline");
    assert!(dom.contains("setosa"));
    let shot = dir.path().join("dt.png");
    let out = chromium(
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=900,700",
        ],
        &url,
    );
    assert!(
        shot.exists(),
        "no screenshot: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let colours = distinct_colours(&shot);
    assert!(colours > 20, "the page looks blank: {colours} colours");
}

#[test]
fn other_html_values_become_html_displays() {
    let mut w = worker();
    let r = run(
        &mut w,
        "htmltools::tags$b('bold')\n\
         knitr::kable(head(mtcars, 2), format = 'html')\n\
         knitr::kable(head(mtcars, 1))\n\
         flextable::flextable(head(mtcars, 2))",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.displays.len(), 3, "{:?}", r.displays);
    assert!(text(&r, 0, "text/html").contains("<b>bold</b>"));
    assert!(text(&r, 1, "text/html").contains("<table"));
    assert_eq!(r.displays[1].metadata["rvisor"]["class"], "knitr_kable");
    // A kable that is not HTML prints as text, as in R.
    assert!(r.console.contains("|Mazda RX4 |"), "{}", r.console);
    assert!(text(&r, 2, "text/html").contains("mpg"));
    assert_eq!(r.displays[2].metadata["rvisor"]["class"], "flextable");
}

#[test]
fn plots_come_as_png_svg_or_both_and_as_displays() {
    let mut w = worker();
    let code = "plot(1:10); hist(c(1, 2, 2, 3))";
    let fmt = |f| {
        with(DisplayOptions {
            plot_format: Some(f),
            ..DisplayOptions::default()
        })
    };
    let r = w.run(code, &fmt(PlotFormat::Png));
    assert_eq!(r.plots.len(), 2);
    assert_eq!(r.displays.len(), 2);
    assert_eq!(
        r.displays[1].data["image/png"],
        r.plots[1].data_base64.as_str()
    );
    assert!(r.displays[0].data.get("image/svg+xml").is_none());
    assert_eq!(r.displays[0].metadata["image/png"]["width"], 1000);
    let r = w.run(code, &fmt(PlotFormat::Svg));
    assert_eq!(r.plots.len(), 2);
    assert!(r.plots.iter().all(|p| p.mime == "image/svg+xml"));
    let svg = text(&r, 0, "image/svg+xml");
    assert!(svg.contains("<svg"), "{}", &svg[..svg.len().min(200)]);
    assert!(r.displays[0].data.get("image/png").is_none());
    let r = w.run(code, &fmt(PlotFormat::Both));
    assert_eq!(r.plots.len(), 2);
    assert!(r.plots.iter().all(|p| p.mime == "image/png"));
    for i in 0..2 {
        assert!(r.displays[i].data.contains_key("image/png"));
        assert!(text(&r, i, "image/svg+xml").contains("<svg"));
    }
    // Each page once as a plot segment and once as a display segment.
    assert_eq!(display_segments(&r), vec![0, 1]);
    // Adding to the last plot in the next call still works with SVG.
    let r = w.run("abline(h = 5)", &fmt(PlotFormat::Both));
    assert_eq!(r.plots.len(), 1, "{}", r.console);
    assert!(text(&r, 0, "image/svg+xml").contains("<svg"));
    // A page of two panels is one page, and its SVG is drawn once both are
    // on it: 100 points against the next page's 2. (The page hook runs for
    // each panel; the SVG was once recorded when the second panel began,
    // with the first panel alone.) The call's `par()` opens the device,
    // which replays the last call's page; that page got only settings,
    // so it is not reported again.
    let r = w.run(
        "par(mfrow = c(1, 2)); plot(1:50); plot(1:50); par(mfrow = c(1, 1)); plot(1:2)",
        &fmt(PlotFormat::Both),
    );
    assert_eq!(r.plots.len(), 2, "{}", r.console);
    let (two_panels, two_points) = (
        text(&r, 0, "image/svg+xml").len(),
        text(&r, 1, "image/svg+xml").len(),
    );
    assert!(
        two_panels > two_points * 3 / 2,
        "{two_panels} bytes of SVG for 2 panels of 50 points, {two_points} for 2 points"
    );
}

#[test]
fn huge_tables_are_bounded_and_cheap() {
    let mut w = worker();
    let r = run(
        &mut w,
        "big <- data.frame(a = seq_len(1e6), b = 'x'); wide <- as.data.frame(matrix(1, 3, 10000))",
    );
    assert_eq!(r.outcome, Outcome::Complete);
    for name in ["big", "wide"] {
        let r = run(&mut w, name);
        assert_eq!(r.outcome, Outcome::Complete, "{name}");
        let d = &r.displays[0];
        let html = text(&r, 0, "text/html");
        let md = text(&r, 0, "text/markdown");
        assert!(
            html.len() < 16 * 1024,
            "{name}: {} bytes of HTML",
            html.len()
        );
        assert!(
            md.len() < 8 * 1024,
            "{name}: {} bytes of Markdown",
            md.len()
        );
        assert!(text(&r, 0, "text/plain").len() <= 64 * 1024);
        let j = &d.data["application/json"];
        assert_eq!(j["truncated"], true);
        assert!(j.to_string().len() < 8 * 1024);
        assert!(j["columns"].as_array().unwrap().len() <= 20);
    }
    let r = run(&mut w, "big");
    assert!(text(&r, 0, "text/html").contains("1000000 × 2"));
    assert!(
        r.displays[0].metadata["rvisor"]["truncated"]["text/plain"].is_string(),
        "the cut text is noted: {:?}",
        r.displays[0].metadata
    );
    let r = run(&mut w, "wide");
    assert!(text(&r, 0, "text/html").contains("3 × 10000"));
}

#[test]
fn huge_html_is_left_out_with_a_note_and_the_cap_is_per_call() {
    let mut w = worker();
    let r = run(&mut w, "htmltools::HTML(strrep('x', 6e6))");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    let d = &r.displays[0];
    assert!(!d.data.contains_key("text/html"));
    assert!(text(&r, 0, "text/plain").contains("over display.html_max_bytes"));
    assert!(d.metadata["rvisor"]["truncated"]["text/html"]
        .as_str()
        .unwrap()
        .contains("6000096 bytes, over"));
    let small = with(DisplayOptions {
        html_max_bytes: Some(1000),
        ..DisplayOptions::default()
    });
    let r = w.run("htmltools::tags$p(strrep('y', 2000))", &small);
    assert!(!r.displays[0].data.contains_key("text/html"));
    // Under the call's output cap too: the bundle keeps only its text.
    let tight = CallOptions {
        max_output_bytes: 4096,
        ..CallOptions::default()
    };
    let r = w.run(
        "cat(strrep('a', 3000), '\\n'); htmltools::tags$p(strrep('z', 2000))",
        &tight,
    );
    assert!(r.truncated);
    assert!(r.truncated_fields.contains(&"displays".to_string()));
    assert!(r.displays[0].data.contains_key("text/plain"));
    assert!(!r.displays[0].data.contains_key("text/html"));
}

#[test]
fn a_widget_whose_dependency_cannot_be_read_says_so_and_the_session_goes_on() {
    let mut w = worker();
    let r = run(
        &mut w,
        "dep <- htmltools::htmlDependency('gone', '1.0', src = c(file = '/nonexistent/dir'), \
         script = 'gone.js')\n\
         htmltools::attachDependencies(htmltools::tags$div('x'), dep)",
    );
    assert_eq!(r.outcome, Outcome::UnsupportedOutput, "{}", r.console);
    assert!(
        r.console.contains("dependency 'gone' cannot be read"),
        "{}",
        r.console
    );
    let dep_url = run(
        &mut w,
        "dep <- htmltools::htmlDependency('cdn', '1.0', src = c(href = 'https://example.com'), \
         script = 'a.js')\n\
         htmltools::attachDependencies(htmltools::tags$div('x'), dep)",
    );
    assert_eq!(dep_url.outcome, Outcome::UnsupportedOutput);
    assert!(
        dep_url.console.contains("only a URL"),
        "{}",
        dep_url.console
    );
    assert_eq!(run(&mut w, "1 + 1").console, "[1] 2\n");
}

#[test]
fn a_print_method_that_errors_or_loops_ends_its_call_not_the_session() {
    let mut w = worker();
    let r = run(
        &mut w,
        "print.boom <- function(x, ...) stop('boom in print')\n\
         structure(data.frame(a = 1), class = c('boom', 'data.frame'))",
    );
    assert_eq!(r.outcome, Outcome::Error);
    assert!(r.console.contains("boom in print"));
    assert!(r.displays.is_empty());
    let short = CallOptions {
        timeout: Some(Duration::from_secs(2)),
        ..CallOptions::default()
    };
    let r = w.run(
        "print.spin <- function(x, ...) repeat {}\n\
         structure(data.frame(a = 1), class = c('spin', 'data.frame'))",
        &short,
    );
    assert_eq!(r.outcome, Outcome::TimedOut, "{}", r.console);
    let r = run(&mut w, "data.frame(a = 1:2)");
    assert_eq!(r.outcome, Outcome::Complete);
    assert_eq!(r.displays.len(), 1);
}

#[test]
fn bad_display_options_are_refused_with_what_to_change() {
    let mut w = worker();
    let r = w.run("1", &limits(0, 5));
    assert_eq!(r.outcome, Outcome::Rejected);
    assert!(r.console.contains("display.max_rows is 0"), "{}", r.console);
}

fn http(
    agent: &ureq::Agent,
    method: &str,
    url: &str,
    body: Option<Value>,
    accept: &str,
) -> (u16, String) {
    let req = agent
        .request(method, url)
        .set("Accept", accept)
        .set("Content-Type", "application/json");
    let res = match body {
        Some(b) => req.send_string(&b.to_string()),
        None => req.call(),
    };
    let res = match res {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{method} {url}: {e}"),
    };
    (res.status(), res.into_string().unwrap())
}

#[test]
fn http_and_jsonl_carry_displays_and_take_display_options() {
    let srv = rvisor_ffi_tests::ServeBin::start(&[]);
    let base = format!("http://{}", srv.addr);
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(120))
        .build();
    let (status, body) = http(
        &agent,
        "POST",
        &format!("{base}/v1/sessions"),
        Some(serde_json::json!({"display": {"max_rows": 2}})),
        "application/json",
    );
    assert_eq!(status, 201, "{body}");
    let id = serde_json::from_str::<Value>(&body).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let run = |code: &str, display: Value, accept: &str| {
        http(
            &agent,
            "POST",
            &format!("{base}/v1/sessions/{id}/run"),
            Some(serde_json::json!({"code": code, "display": display})),
            accept,
        )
    };
    let (status, body) = run("head(mtcars)", Value::Null, "application/json");
    assert_eq!(status, 200, "{body}");
    let r: Value = serde_json::from_str(&body).unwrap();
    let j = &r["displays"][0]["data"]["application/json"];
    assert_eq!(
        j["rows"].as_array().unwrap().len(),
        2,
        "the session's limit"
    );
    // A call's option goes over the session's.
    let (_, body) = run(
        "head(mtcars)",
        serde_json::json!({"max_rows": 4}),
        "application/json",
    );
    let r: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        r["displays"][0]["data"]["application/json"]["rows"]
            .as_array()
            .unwrap()
            .len(),
        4
    );
    let (status, body) = run("1", serde_json::json!({"max_rows": 0}), "application/json");
    assert!((400..500).contains(&status), "{status} {body}");
    let (status, body) = run("htmltools::tags$i('it')", Value::Null, "text/html");
    assert_eq!(status, 200);
    assert!(
        body.contains("<iframe sandbox=\"allow-scripts\" srcdoc=\""),
        "{body}"
    );
    assert!(body.contains("&lt;i&gt;it&lt;/i&gt;"), "{body}");
    // One-shot runs too.
    let (status, body) = http(
        &agent,
        "POST",
        &format!("{base}/v1/run"),
        Some(serde_json::json!({"script": "plot(1:2)", "display": {"plot_format": "svg"}})),
        "application/json",
    );
    assert_eq!(status, 200, "{body}");
    let r: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(r["plots"][0]["mime"], "image/svg+xml");
    assert!(r["displays"][0]["data"]["image/svg+xml"]
        .as_str()
        .unwrap()
        .contains("<svg"));

    // session --jsonl: the same JSON, the same options.
    use std::io::{BufRead, Write};
    let mut child = std::process::Command::new(rvisor_ffi_tests::rvisor_bin())
        .args(["--unconfined", "session", "--jsonl"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("rvisor session --jsonl starts");
    let mut stdin = child.stdin.take().unwrap();
    writeln!(
        stdin,
        "{}",
        serde_json::json!({"id": 1, "op": "run", "code": "data.frame(a = 1:5)", "display": {"max_rows": 1}})
    )
    .unwrap();
    stdin.flush().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    drop(stdin);
    let v: Value = serde_json::from_str(&line).unwrap();
    let d = &v["result"]["displays"][0];
    assert_eq!(d["data"]["application/json"]["nrow"], 5, "{line}");
    assert_eq!(
        d["data"]["application/json"]["rows"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert!(d["data"]["text/markdown"]
        .as_str()
        .unwrap()
        .contains("5 × 1"));
    let _ = child.wait();
}

#[test]
fn the_cli_writes_displays_next_to_plots() {
    let dir = TestDir::new("rvisor-cli-displays");
    let script = dir.path().join("s.R");
    std::fs::write(
        &script,
        "head(mtcars, 3)\nhtmltools::tags$b('x')\nplot(1:3)\n",
    )
    .unwrap();
    let out_dir = dir.path().join("out");
    let out = std::process::Command::new(rvisor_ffi_tests::rvisor_bin())
        .arg("--unconfined")
        .arg("run")
        .arg(&script)
        .args(["--plot-format", "both", "--max-rows", "2", "--plots-dir"])
        .arg(&out_dir)
        .output()
        .expect("rvisor run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("shown as HTML"), "{stderr}");
    for f in [
        "display-001.html",
        "display-001.md",
        "display-001.json",
        "display-002.html",
        "plot-001.png",
        "plot-001.svg",
    ] {
        assert!(out_dir.join(f).exists(), "{f} missing; {stderr}");
    }
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("display-001.json")).unwrap())
            .unwrap();
    assert_eq!(json["rows"].as_array().unwrap().len(), 2);
    let bad = std::process::Command::new(rvisor_ffi_tests::rvisor_bin())
        .arg("run")
        .arg(&script)
        .args(["--plot-format", "gif"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("png, svg or both"));
}

fn values_on() -> CallOptions {
    with(DisplayOptions {
        values: Some(true),
        ..DisplayOptions::default()
    })
}

/// Display option `values`: each visible top-level value is a display
/// whose text/plain is exactly what R prints (the same text the console
/// has with the option off), held apart from the console; the last one is
/// marked; tables keep their bundle; explicit print() stays console text.
#[test]
fn values_are_displays_with_the_text_r_prints_and_the_last_is_marked() {
    let mut w = worker();
    let code = "1\ncat('mid\\n')\nlist(a = 1, b = 'x')\nprint('p')\ndata.frame(a = 1:2)\nx <- 3";
    let off = run(&mut w, code);
    let on = w.run(code, &values_on());
    assert_eq!(on.outcome, Outcome::Complete, "{}", on.console);
    assert_eq!(
        on.console, "mid\n[1] \"p\"\n",
        "values are not console text"
    );
    assert_eq!(on.displays.len(), 3, "{:?}", on.displays);
    let kinds: Vec<&str> = on
        .displays
        .iter()
        .map(|d| d.metadata["rvisor"]["kind"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(kinds, ["value", "value", "table"]);
    // Together with the console, the texts are what R printed with the
    // option off, in the same order.
    let shown = format!(
        "{}mid\n{}[1] \"p\"\n{}",
        text(&on, 0, "text/plain"),
        text(&on, 1, "text/plain"),
        text(&on, 2, "text/plain")
    );
    assert_eq!(shown, off.console);
    assert_eq!(on.displays[0].metadata["rvisor"]["class"], "numeric");
    assert_eq!(on.displays[1].metadata["rvisor"]["class"], "list");
    let last: Vec<bool> = on
        .displays
        .iter()
        .map(|d| d.metadata["rvisor"]["last"] == Value::Bool(true))
        .collect();
    assert_eq!(last, [false, false, true]);
    // Each is a visible value's (a kernel holds those back until it knows
    // which was the last); rvisor_display()'s is not.
    assert!(on
        .displays
        .iter()
        .all(|d| d.metadata["rvisor"]["value"] == Value::Bool(true)));
    let explicit = w.run(
        "rvisor_display(data.frame(a = 1)); invisible(1)",
        &values_on(),
    );
    assert_eq!(explicit.displays.len(), 1, "{:?}", explicit.displays);
    assert!(explicit.displays[0].metadata["rvisor"]
        .get("value")
        .is_none());
    assert!(text(&on, 2, "text/html").contains("<table"));
    // Displays sit where the values were, between the console's segments.
    let order: Vec<&str> = on
        .segments
        .iter()
        .map(|s| match s {
            Segment::Stdout { .. } => "out",
            Segment::Display { .. } => "display",
            _ => "other",
        })
        .collect();
    assert_eq!(order, ["display", "out", "display", "out", "display"]);
    // Off by default: the other surfaces see what they saw.
    let plain = run(&mut w, "1");
    assert!(plain.displays.is_empty() && plain.console == "[1] 1\n");
}

/// With `values`, a value too long for a display keeps 64 KiB and says so;
/// a print method that fails leaves its partial text on the console and
/// ends the call with its error; a value after an invisible one is still
/// the last; nothing visible: nothing marked.
#[test]
fn values_at_their_limits_and_with_failing_prints() {
    let mut w = worker();
    let r = w.run("strrep('x', 200000)", &values_on());
    assert_eq!(r.displays.len(), 1);
    let t = text(&r, 0, "text/plain");
    assert!(
        t.len() <= 64 * 1024 && t.starts_with("[1] \"xxx"),
        "{}",
        t.len()
    );
    let why = r.displays[0].metadata["rvisor"]["truncated"]["text/plain"]
        .as_str()
        .unwrap_or("");
    assert!(why.contains("64 KiB"), "{:?}", r.displays[0].metadata);
    assert!(r.console.is_empty());

    let r = w.run(
        "print.bad <- function(x, ...) { cat('partial\\n'); stop('no print') }\nstructure(1, class = 'bad')",
        &values_on(),
    );
    assert_eq!(r.outcome, Outcome::Error);
    assert!(r.console.starts_with("partial\n"), "{}", r.console);
    assert!(r.displays.is_empty());

    let r = w.run("invisible(1)\ny <- 2", &values_on());
    assert!(r.displays.is_empty() && r.console.is_empty());

    let r = w.run(
        "plot(1)\n42\ninvisible(0)",
        &CallOptions {
            timeout: Some(Duration::from_secs(60)),
            ..values_on()
        },
    );
    assert_eq!(r.displays.len(), 2, "{:?}", r.displays);
    assert_eq!(text(&r, 0, "text/plain"), "[1] 42\n");
    assert_eq!(r.displays[0].metadata["rvisor"]["last"], true);
    assert_eq!(r.displays[1].metadata["rvisor"]["kind"], "plot");
}
