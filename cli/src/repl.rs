//! `rvisor repl`: an interactive persistent session for a person.

use crate::out;
use anyhow::{Context, Result};
use base64::Engine;
use rustyline::error::ReadlineError;
use rvisor::{Outcome, RunResult, Session};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

const HELP: &str = "\
rvisor repl: R in a persistent embedded session.
  :status   show the session's status
  :reset    start a fresh R session (variables are lost)
  :help     this help
  :quit     leave (also Ctrl-D)
Ctrl-C interrupts the running call; variables are kept.
Plots are saved as PNG files, tables and HTML values as .html, .md and .json
files next to them, and their paths printed.";

/// Whether R's parser stopped because the input is not finished yet.
fn incomplete(r: &RunResult) -> bool {
    r.outcome == Outcome::ParseError
        && r.error.as_ref().is_some_and(|e| {
            e.message.contains("unexpected end of input") || e.message.contains("INCOMPLETE_STRING")
        })
}

/// Follows a call's events, printing them as they come, except for code
/// that does not parse (nothing runs then: its error is printed only if
/// the input is not merely incomplete).
fn follow_quiet_if_incomplete(handle: &rvisor::CallHandle) -> Result<(RunResult, Option<String>)> {
    let mut events = handle.events();
    // A parse error is known before anything else is printed: look at the
    // first event.
    let Some(first) = events.next() else {
        anyhow::bail!("the call ended without a result");
    };
    if let rvisor::EventKind::Result { result } = first.kind {
        return Ok((*result, None));
    }
    if matches!(&first.kind, rvisor::EventKind::Stderr { text } if text.starts_with("Error: parse error"))
    {
        let r = handle.clone().wait();
        return Ok((r, None));
    }
    let (r, printed) = super::follow_events(Some(first), events)?;
    Ok((r, Some(printed)))
}

fn print_result(
    r: &RunResult,
    printed: &Option<String>,
    plots_dir: &Path,
    counter: &mut usize,
    displays: &mut usize,
) -> Result<()> {
    let on_plot = |p: &rvisor::Plot, err: &mut dyn Write| -> Result<()> {
        std::fs::create_dir_all(plots_dir)
            .with_context(|| format!("failed to create {}", plots_dir.display()))?;
        *counter += 1;
        let ext = if p.mime == "image/svg+xml" {
            "svg"
        } else {
            "png"
        };
        let path = plots_dir.join(format!("plot-{:03}.{ext}", *counter));
        let data = base64::engine::general_purpose::STANDARD.decode(&p.data_base64)?;
        std::fs::write(&path, data)
            .with_context(|| format!("failed to write {}", path.display()))?;
        writeln!(err, "[plot saved to {}]", path.display())?;
        Ok(())
    };
    match printed {
        Some(printed) => super::print_rest(r, printed, on_plot)?,
        None => super::print_console(r, on_plot)?,
    }
    let mut err = std::io::stderr().lock();
    // Displays: an HTML value's text line (a table's text is in the
    // console already), then the files of every display.
    for d in &r.displays {
        let kind = d.metadata.get("rvisor").and_then(|m| m.get("kind"));
        if kind.and_then(|k| k.as_str()) == Some("html") {
            if let Some(t) = d.data.get("text/plain").and_then(|t| t.as_str()) {
                writeln!(err, "{t}")?;
            }
        }
    }
    let before = counter.saturating_sub(r.plots.len());
    for path in crate::displays::save(r, plots_dir, displays, before)? {
        writeln!(err, "[display saved to {}]", path.display())?;
    }
    if r.truncated {
        writeln!(err, "[output truncated at the output limit]")?;
    }
    if matches!(r.outcome, Outcome::Interrupted) {
        writeln!(err, "[interrupted; variables are kept]")?;
    }
    Ok(())
}

/// Runs the REPL on `session` until the user leaves.
pub fn run(session: Session, plots_dir: PathBuf) -> Result<ExitCode> {
    // Ctrl-C while a call runs interrupts it; while typing, rustyline sees
    // the key itself (raw mode) and clears the line.
    let current: Arc<Mutex<Option<Session>>> = Arc::new(Mutex::new(None));
    {
        let current = current.clone();
        ctrlc::set_handler(move || {
            if let Some(s) = current.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                s.interrupt();
            }
        })
        .context("failed to install the Ctrl-C handler")?;
    }
    let mut rl = rustyline::DefaultEditor::new().context("failed to start line editing")?;
    let history = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".rvisor_history"));
    if let Some(h) = &history {
        let _ = rl.load_history(h);
    }
    eprintln!("rvisor repl (R in an embedded worker). :help for commands, Ctrl-D to leave.");
    let mut buffer = String::new();
    let mut counter = 0usize;
    let mut displays = 0usize;
    loop {
        let prompt = if buffer.is_empty() { "> " } else { "+ " };
        let line = match rl.readline(prompt) {
            Ok(l) => l,
            Err(ReadlineError::Interrupted) => {
                buffer.clear();
                continue;
            }
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e).context("failed to read input"),
        };
        if buffer.is_empty() {
            match line.trim() {
                "" => continue,
                ":quit" | ":q" => break,
                ":help" => {
                    eprintln!("{HELP}");
                    continue;
                }
                ":status" => {
                    out::line(serde_json::to_string_pretty(&session.status())?)?;
                    continue;
                }
                ":reset" => {
                    session.reset();
                    eprintln!("[the next call starts in a fresh R session]");
                    continue;
                }
                _ => {}
            }
        }
        if !buffer.is_empty() {
            buffer.push('\n');
        }
        buffer.push_str(&line);
        // Printed here as it comes: this reader always reads, so nothing
        // it is sent may be dropped (the output cap bounds the text).
        let over = rvisor::RunOptions {
            stream_limits: rvisor::StreamLimits::unbounded(),
            ..rvisor::RunOptions::default()
        };
        let handle = match session.run_streaming_with(&buffer, &over) {
            Ok(h) => h,
            Err(e) => {
                eprintln!("rvisor: {e}");
                buffer.clear();
                continue;
            }
        };
        *current.lock().unwrap_or_else(|e| e.into_inner()) = Some(session.clone());
        // Output is printed as it comes; an incomplete input prints only
        // R's parse error, which is not shown (more input follows).
        let (result, printed) = follow_quiet_if_incomplete(&handle)?;
        *current.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if incomplete(&result) {
            continue; // keep reading: R needs more input
        }
        let _ = rl.add_history_entry(buffer.as_str());
        buffer.clear();
        print_result(&result, &printed, &plots_dir, &mut counter, &mut displays)?;
    }
    if let Some(h) = &history {
        let _ = rl.save_history(h);
    }
    session.close();
    Ok(ExitCode::SUCCESS)
}
