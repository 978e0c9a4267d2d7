//! The command's standard output, one way for every command: a reader
//! that went away (`rvisor run x.R | head`, `rvisor health | head -1`)
//! ends the command quietly and with success, as the system's own
//! commands end on SIGPIPE in a pipeline, not with a panic of `println!`
//! or "rvisor: Broken pipe (os error 32)" and status 2.
//!
//! Writes go through [`stdout`] (or [`emit`]); a broken pipe comes back as
//! an I/O error carrying [`ReaderGone`], which `?` passes up like any
//! other, and [`exit`] turns into a quiet success at the top.

use std::io::{self, Write};
use std::process::ExitCode;

/// The reader of standard output went away.
#[derive(Debug)]
pub(crate) struct ReaderGone;

impl std::fmt::Display for ReaderGone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the reader of standard output went away")
    }
}

impl std::error::Error for ReaderGone {}

/// A broken pipe marked as the reader's going away; other errors as they
/// are.
fn mark(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::BrokenPipe {
        io::Error::new(io::ErrorKind::BrokenPipe, ReaderGone)
    } else {
        e
    }
}

/// A writer whose broken pipe is [`ReaderGone`].
pub(crate) struct Marked<W>(W);

/// Standard output, locked, whose broken pipe is [`ReaderGone`].
pub(crate) type Stdout = Marked<io::StdoutLock<'static>>;

/// Standard output for a command's writes.
pub(crate) fn stdout() -> Stdout {
    Marked(io::stdout().lock())
}

/// Standard output, unlocked between writes (for a writer moved to another
/// thread, as `rvisor session --jsonl`'s), whose broken pipe is
/// [`ReaderGone`].
pub(crate) type SharedStdout = Marked<io::Stdout>;

/// Standard output for a writer that crosses threads.
pub(crate) fn shared_stdout() -> SharedStdout {
    Marked(io::stdout())
}

impl<W: Write> Write for Marked<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf).map_err(mark)
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.0.write_all(buf).map_err(mark)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush().map_err(mark)
    }
}

/// Writes `text` to standard output and flushes it.
pub(crate) fn emit(text: &str) -> io::Result<()> {
    let mut out = stdout();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// Writes `text` and a newline to standard output (`println!` that does
/// not panic).
pub(crate) fn line(text: impl std::fmt::Display) -> io::Result<()> {
    emit(&format!("{text}\n"))
}

/// Whether `e` is (caused by) the reader of standard output going away.
pub(crate) fn is_reader_gone(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.is::<ReaderGone>()
            || c.downcast_ref::<io::Error>().is_some_and(|io| {
                io.kind() == io::ErrorKind::BrokenPipe
                    && io.get_ref().is_some_and(|r| r.is::<ReaderGone>())
            })
    })
}

/// A command's status: its own, a quiet success when its reader went
/// away, else its error on stderr and `failure`.
pub(crate) fn exit_with(r: anyhow::Result<ExitCode>, failure: u8) -> ExitCode {
    match r {
        Ok(code) => code,
        Err(e) if is_reader_gone(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rvisor: {e:#}");
            ExitCode::from(failure)
        }
    }
}

/// [`exit_with`] status 2, the commands' status for an error of their own.
pub(crate) fn exit(r: anyhow::Result<ExitCode>) -> ExitCode {
    exit_with(r, 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_pipe_is_the_reader_going_away_and_nothing_else_is() {
        let gone = anyhow::Error::from(mark(io::Error::from(io::ErrorKind::BrokenPipe)));
        assert!(is_reader_gone(&gone));
        assert!(is_reader_gone(&gone.context("writing the result")));
        let other = anyhow::Error::from(mark(io::Error::from(io::ErrorKind::PermissionDenied)));
        assert!(!is_reader_gone(&other));
        // A broken pipe elsewhere (a worker's socket) is an error.
        let socket = anyhow::Error::from(io::Error::from(io::ErrorKind::BrokenPipe));
        assert!(!is_reader_gone(&socket));
    }
}
