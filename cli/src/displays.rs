//! Display flags of `run`, `session` and `repl`, and writing a result's
//! displays as files next to its plots (`--plots-dir`).

use anyhow::{Context, Result};
use rvisor::{DisplayOptions, PlotFormat, RunResult};
use std::path::{Path, PathBuf};

/// Which rich results calls make (docs/output-and-plots.md, "Displays").
#[derive(clap::Args, Debug, Clone)]
pub struct DisplayArgs {
    /// Make no displays: values print as text only, an HTML-only value is
    /// `unsupported_output`, plots are only in `plots`.
    #[arg(long)]
    pub no_displays: bool,
    /// Rows of a table shown as HTML, Markdown and the JSON preview.
    #[arg(long, value_name = "N")]
    pub max_rows: Option<u32>,
    /// Columns of a table shown as HTML and Markdown.
    #[arg(long, value_name = "N")]
    pub max_cols: Option<u32>,
    /// Image formats of plot pages: png, svg or both.
    #[arg(long, value_name = "FORMAT", value_parser = parse_format)]
    pub plot_format: Option<PlotFormat>,
}

fn parse_format(s: &str) -> Result<PlotFormat, String> {
    match s {
        "png" => Ok(PlotFormat::Png),
        "svg" => Ok(PlotFormat::Svg),
        "both" => Ok(PlotFormat::Both),
        _ => Err(format!("{s:?} is not a plot format; use png, svg or both")),
    }
}

impl DisplayArgs {
    /// The options these flags ask for.
    pub fn options(&self) -> DisplayOptions {
        DisplayOptions {
            enabled: self.no_displays.then_some(false),
            max_rows: self.max_rows,
            max_cols: self.max_cols,
            plot_format: self.plot_format,
            ..DisplayOptions::default()
        }
    }
}

/// Writes each value display of `r` into `dir` as `display-NNN.html`,
/// `.md` and `.json` (whichever it has), and each SVG page as
/// `plot-NNN.svg` (PNG pages are written from `plots`; pages numbered
/// from `plots_before + 1`), numbering displays from `*counter + 1`.
/// Returns the files written.
pub fn save(
    r: &RunResult,
    dir: &Path,
    counter: &mut usize,
    plots_before: usize,
) -> Result<Vec<PathBuf>> {
    let mut saved = Vec::new();
    let mut page = plots_before;
    for d in &r.displays {
        let is_plot = d
            .metadata
            .get("rvisor")
            .and_then(|m| m.get("kind"))
            .and_then(|k| k.as_str())
            == Some("plot");
        let stem = if is_plot {
            page += 1;
            format!("plot-{page:03}")
        } else {
            *counter += 1;
            format!("display-{:03}", *counter)
        };
        for (mime, ext) in [
            ("text/html", "html"),
            ("text/markdown", "md"),
            ("application/json", "json"),
            ("image/svg+xml", "svg"),
        ] {
            let Some(v) = d.data.get(mime) else { continue };
            let text = match v {
                serde_json::Value::String(s) => s.clone(),
                other => serde_json::to_string_pretty(other)?,
            };
            std::fs::create_dir_all(dir)
                .with_context(|| format!("failed to create {}", dir.display()))?;
            let path = dir.join(format!("{stem}.{ext}"));
            std::fs::write(&path, text)
                .with_context(|| format!("failed to write {}", path.display()))?;
            saved.push(path);
        }
    }
    Ok(saved)
}
