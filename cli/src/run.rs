//! `rvisor run`: one script in a fresh worker, its output printed as it
//! comes (or one RunResult as JSON), plots and files saved where asked.

use crate::console::{follow_events, print_console, print_rest};
use crate::{displays, files, supervisor_quiet};
use anyhow::{bail, Context, Result};
use base64::Engine;
use rvisor::{CallOptions, Outcome, RunResult};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Arguments of `rvisor run`.
#[derive(clap::Args, Debug)]
pub(crate) struct RunArgs {
    /// The script, or `-` for standard input.
    file: String,
    /// Print one RunResult as JSON instead of the console output.
    #[arg(long)]
    json: bool,
    /// Time limit in seconds (0 = none).
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
    /// Write plots as PNG files into this directory.
    #[arg(long)]
    plots_dir: Option<PathBuf>,
    /// Plot width in pixels.
    #[arg(long, default_value_t = rvisor::DEFAULT_PLOT_WIDTH)]
    width: u32,
    /// Plot height in pixels.
    #[arg(long, default_value_t = rvisor::DEFAULT_PLOT_HEIGHT)]
    height: u32,
    /// Bind an R variable before the script runs (repeatable). VALUE is
    /// JSON when it parses (42, true, [1,2], "text"), else a string.
    #[arg(long = "var", value_name = "NAME=VALUE")]
    vars: Vec<String>,
    /// Load a CSV file as a data frame before the script runs
    /// (repeatable); column types are inferred, NA and empty are missing.
    #[arg(long = "table", value_name = "NAME=FILE.csv")]
    tables: Vec<String>,
    #[command(flatten)]
    display: displays::DisplayArgs,
    /// Put FILE in the run's working directory, under its file name,
    /// before the script runs (repeatable). With it or --output-dir the
    /// script runs in a private directory, not the current one.
    #[arg(long = "input", value_name = "FILE")]
    inputs: Vec<PathBuf>,
    /// Copy the files the script wrote (new or changed in its working
    /// directory; tempdir() left out) into DIR, and list them as the
    /// result's `artifacts` (docs/files.md).
    #[arg(long, value_name = "DIR")]
    output_dir: Option<PathBuf>,
    /// A library after R's own on .libPaths() (repeatable), e.g. the one
    /// `rvisor packages install` names (read-only when confined).
    #[arg(long = "library-after", value_name = "DIR")]
    library_after: Vec<PathBuf>,
}

pub(crate) fn read_code(file: &str) -> Result<String> {
    let mut bytes = Vec::new();
    if file == "-" {
        std::io::stdin()
            .read_to_end(&mut bytes)
            .context("failed to read the script from stdin")?;
    } else {
        bytes = std::fs::read(file).with_context(|| format!("failed to read {file}"))?;
    }
    String::from_utf8(bytes).map_err(|_| {
        anyhow::anyhow!("{file} is not UTF-8 text; convert it (e.g. iconv -t UTF-8) and retry")
    })
}

pub(crate) fn run(args: &RunArgs) -> Result<ExitCode> {
    let RunArgs {
        file,
        json,
        timeout,
        plots_dir,
        width,
        height,
        vars,
        tables: table_args,
        display,
        inputs,
        output_dir,
        library_after,
    } = args;
    let with_files = !inputs.is_empty() || output_dir.is_some();
    for p in inputs {
        if !p.is_file() {
            bail!("--input {}: not a readable file", p.display());
        }
    }
    let (json, timeout, width, height) = (*json, *timeout, *width, *height);
    let code = read_code(file)?;
    // Tables go through the same conversion as uploads, into a private
    // directory that lives as long as this command.
    let table_dir =
        std::env::temp_dir().join(format!("rvisor-run-tables-{}", rvisor::ids::random_hex(6)));
    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Cleanup(table_dir.clone());
    let mut table_files = Vec::new();
    for t in table_args {
        let Some((name, path)) = t.split_once('=') else {
            bail!("--table {t:?}: expected NAME=FILE.csv");
        };
        table_files.push((name, path));
    }
    let mut variables = Vec::new();
    for v in vars {
        let Some((name, value)) = v.split_once('=') else {
            bail!("--var {v:?}: expected NAME=VALUE");
        };
        let value = serde_json::from_str(value)
            .unwrap_or_else(|_| serde_json::Value::String(value.to_string()));
        variables.push((name.to_string(), value));
    }
    // The same checks as a one-shot run of the service (names, values,
    // counts, no name used twice), before a name becomes a file name.
    let names: Vec<&str> = table_files.iter().map(|(n, _)| *n).collect();
    rvisor_server::service::check_bindings(&variables, &names, &rvisor::SafetyRules::default())
        .map_err(|e| anyhow::anyhow!("--var/--table: {e}"))?;
    let mut tables = Vec::new();
    for (name, path) in table_files {
        std::fs::metadata(path).with_context(|| format!("failed to read {path}"))?;
        std::fs::create_dir_all(&table_dir)?;
        let out = table_dir.join(format!("{name}.arrow"));
        rvisor_server::tables::convert_file(
            rvisor_server::tables::TableFormat::Csv,
            std::path::Path::new(path),
            &out,
        )
        .map_err(|e| anyhow::anyhow!("--table {name}: {e}"))?;
        tables.push((name.to_string(), out));
    }
    let ctx = rvisor::CallContext {
        variables,
        tables,
        libraries_after: library_after.clone(),
        ..Default::default()
    };
    if !(timeout >= 0.0 && timeout.is_finite()) {
        bail!("--timeout must be a number of seconds >= 0 (0 means no limit)");
    }
    let mut opts = CallOptions {
        timeout: (timeout > 0.0).then(|| Duration::from_secs_f64(timeout)),
        plot_width: width,
        plot_height: height,
        display: display.options(),
        ..CallOptions::default()
    };
    let execution_id = rvisor::ids::execution_id();
    // The console text printed while the run went on (not with --json).
    let mut streamed: Option<String> = None;
    // The library's own call checks (one definition): a bad plot size is a
    // flag error; empty or oversize code is a rejected run, no R started.
    let checked = rvisor::validate_call(&code, &opts);
    if let Err(e @ rvisor::CallError::PlotSize { .. }) = &checked {
        bail!("--width/--height: {e}");
    }
    if let Err(e @ rvisor::CallError::Display(_)) = &checked {
        bail!("--max-rows/--max-cols: {e}");
    }
    let result = if let Err(e) = checked {
        RunResult::failed(execution_id, code, Outcome::Rejected, e.to_string())
    } else {
        let sup = supervisor_quiet()?;
        // Unconfined, the script runs in the current directory; confined, in
        // its private one (pass --read-only PATH to let it read host files).
        let cwd = std::env::current_dir().ok();
        let working_dir = match &sup.config().worker.confine {
            None => cwd,
            Some(c) => cwd.filter(|d| c.read_only.iter().any(|r| d.starts_with(r))),
        };
        // With files, the script runs in the worker's private directory.
        opts.working_dir = working_dir.filter(|_| !with_files);
        let mut files = files::CliFiles::new(inputs.clone(), output_dir.clone());
        let mut r = if json {
            if with_files {
                sup.run_once_with_files(
                    execution_id,
                    &code,
                    &opts,
                    &ctx,
                    None,
                    None,
                    None,
                    &mut files,
                )
            } else {
                sup.run_once_with(execution_id, &code, &opts, &ctx)
            }
        } else {
            // Printed as it comes, all of it: this reader always reads
            // (a slow terminal slows the printing, not the call), and the
            // output cap bounds the text.
            let (feed, events) =
                rvisor::EventFeed::with_limits(&execution_id, rvisor::StreamLimits::unbounded());
            let run = {
                let (sup, code, opts) = (sup.clone(), code.clone(), opts.clone());
                std::thread::spawn(move || {
                    let sink = feed.sink();
                    let r = if with_files {
                        sup.run_once_with_files(
                            execution_id,
                            &code,
                            &opts,
                            &ctx,
                            None,
                            None,
                            Some(&sink),
                            &mut files,
                        )
                    } else {
                        sup.run_once_streaming(execution_id, &code, &opts, &ctx, None, None, &sink)
                    };
                    feed.finish(&r);
                    r
                })
            };
            let (_, printed) = follow_events(None, events)?;
            let r = run
                .join()
                .map_err(|_| anyhow::anyhow!("the run failed inside rvisor"))?;
            streamed = Some(printed);
            r
        };
        r.session.id = "run".into();
        sup.shutdown();
        r
    };

    let mut saved = Vec::new();
    if let Some(dir) = &plots_dir {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("failed to create {}", dir.display()))?;
        for (i, p) in result.plots.iter().enumerate() {
            if p.mime != "image/png" {
                continue; // SVG pages are written with the displays
            }
            let path = dir.join(format!("plot-{:03}.png", i + 1));
            let data = base64::engine::general_purpose::STANDARD.decode(&p.data_base64)?;
            std::fs::write(&path, data)
                .with_context(|| format!("failed to write {}", path.display()))?;
            saved.push(path);
        }
        saved.extend(displays::save(&result, dir, &mut 0, 0)?);
    }

    if json {
        // Made first, then written: a broken pipe inside serde_json's
        // error would not say it was the reader's going away.
        crate::out::line(serde_json::to_string(&result)?)?;
    } else {
        match &streamed {
            Some(printed) => print_rest(&result, printed, |_, _| Ok(()))?,
            None => print_console(&result, |_, _| Ok(()))?,
        }
        let mut err = std::io::stderr().lock();
        // An HTML value has no console text: its line says what it was.
        for d in &result.displays {
            let kind = d.metadata.get("rvisor").and_then(|m| m.get("kind"));
            if kind.and_then(|k| k.as_str()) == Some("html") {
                if let Some(t) = d.data.get("text/plain").and_then(|t| t.as_str()) {
                    writeln!(err, "rvisor: {t}")?;
                }
            }
        }
        if result.truncated {
            writeln!(err, "rvisor: output truncated at the output limit")?;
        }
        for p in &saved {
            writeln!(err, "rvisor: saved {}", p.display())?;
        }
        for a in &result.artifacts {
            writeln!(
                err,
                "rvisor: file saved to {} ({} bytes)",
                a.uri.trim_start_matches("file://"),
                a.size
            )?;
        }
        if plots_dir.is_none() && !result.plots.is_empty() {
            writeln!(
                err,
                "rvisor: {} plot(s) not saved; pass --plots-dir DIR to write them as PNG files",
                result.plots.len()
            )?;
        }
        if let Some(v) = &result.result {
            writeln!(err, "rvisor: result = {v}")?;
        }
    }
    Ok(if result.success {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
