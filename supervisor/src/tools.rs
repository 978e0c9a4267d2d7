//! Host tools that R code calls as `tools$name(...)` during a call.

use crate::error::{Error, WorkerFileError};
use serde_json::Value;
use std::fmt;
use std::sync::Arc;

/// One tool call, as the host's handler sees it.
#[derive(Debug, Clone)]
pub struct ToolCall {
    /// The session whose code made the call.
    pub session_id: String,
    /// The call (RunResult `execution_id`) during which the tool was called.
    pub execution_id: String,
    /// The tool's name.
    pub name: String,
    /// Arguments: an object for named arguments (`tools$f(a = 1)`), an
    /// array for positional ones.
    pub args: Value,
    /// The calling worker's private temporary directory: the only place a
    /// handler may read files the R code names (see [`read_worker_file`]).
    pub worker_temp_dir: std::path::PathBuf,
    /// A confined worker's root as the host sees it (`/proc/PID/root`):
    /// its temporary directory is a private tmpfs reachable only there.
    pub worker_root: Option<std::path::PathBuf>,
}

/// Reads a file that R code wrote and named in a tool call, refusing any
/// path outside the calling worker's temporary directory (R code is
/// untrusted: it must not make the host read files for it). The check is
/// made on the opened file (no symlink as the last component, and the real
/// path of the descriptor), so swapping the path after the check does not
/// help.
///
/// For tool handlers, whose errors go to R as text; [`worker_file`] is the
/// same with a typed error.
pub fn read_worker_file(call: &ToolCall, path: &str) -> Result<Vec<u8>, String> {
    worker_file(call, path).map_err(String::from)
}

/// [`read_worker_file`] with an error that says which check failed.
pub fn worker_file(call: &ToolCall, path: &str) -> Result<Vec<u8>, WorkerFileError> {
    use std::io::Read;
    let mut f = open_worker_file(call, path)?;
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes)
        .map_err(|source| WorkerFileError::Read {
            path: path.to_string(),
            source,
        })?;
    Ok(bytes)
}

/// A file the worker wrote in its temporary directory, opened by the
/// same checks as [`worker_file`] (inside the worker's root, no links, a
/// regular file of a sane size), for a caller that copies it in pieces
/// instead of holding it whole.
pub fn open_worker_file(call: &ToolCall, path: &str) -> Result<std::fs::File, WorkerFileError> {
    let f = match &call.worker_root {
        Some(root) => open_confined_file(call, root, path)?,
        None => open_host_file(call, path)?,
    };
    check_regular(&f, path)?;
    Ok(f)
}

/// Largest file a tool may read from a worker.
const MAX_WORKER_FILE_BYTES: u64 = 1 << 30;

/// A confined worker's file: opened inside its root (`openat2` with
/// RESOLVE_IN_ROOT and no symlinks at all), so neither `..` nor a link
/// leads out of it, and only under its temporary directory.
fn open_confined_file(
    call: &ToolCall,
    root: &std::path::Path,
    path: &str,
) -> Result<std::fs::File, WorkerFileError> {
    use std::os::fd::FromRawFd;
    use std::path::Component;
    let p = std::path::Path::new(path);
    let clean = p.is_absolute()
        && p.components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    if !clean || !p.starts_with(&call.worker_temp_dir) {
        return Err(WorkerFileError::OutsideTempDir);
    }
    let dir = std::fs::File::open(root).map_err(WorkerFileError::WorkerGone)?;
    let rel =
        std::ffi::CString::new(path.trim_start_matches('/')).map_err(|_| WorkerFileError::Nul)?;
    /// `struct open_how` of openat2(2).
    #[repr(C)]
    struct OpenHow {
        flags: u64,
        mode: u64,
        resolve: u64,
    }
    let how = OpenHow {
        // O_NONBLOCK: opening a FIFO the code made must not hang this thread
        // (regular files ignore the flag).
        flags: (libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK) as u64,
        mode: 0,
        resolve: libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: openat2 with a directory fd we own, a NUL-terminated path and
    // an open_how struct that live across the call; a returned descriptor
    // becomes owned by the File at once.
    let f = unsafe {
        let fd = libc::syscall(
            libc::SYS_openat2,
            std::os::fd::AsRawFd::as_raw_fd(&dir),
            rel.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        );
        if fd < 0 {
            return Err(WorkerFileError::Open {
                path: path.to_string(),
                source: std::io::Error::last_os_error(),
            });
        }
        std::fs::File::from_raw_fd(fd as i32)
    };
    Ok(f)
}

/// Accepts an opened file only if it is a regular one of a sane size (a
/// FIFO or a device the code made must not block or flood the host).
fn check_regular(f: &std::fs::File, path: &str) -> Result<(), WorkerFileError> {
    let meta = f.metadata().map_err(|source| WorkerFileError::Check {
        path: path.to_string(),
        source,
    })?;
    if !meta.is_file() || meta.len() > MAX_WORKER_FILE_BYTES {
        return Err(WorkerFileError::NotRegular {
            path: path.to_string(),
            max_mib: MAX_WORKER_FILE_BYTES >> 20,
        });
    }
    Ok(())
}

fn open_host_file(call: &ToolCall, path: &str) -> Result<std::fs::File, WorkerFileError> {
    use std::os::unix::fs::OpenOptionsExt;
    let root = std::fs::canonicalize(&call.worker_temp_dir).map_err(WorkerFileError::WorkerGone)?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|source| WorkerFileError::Open {
            path: path.to_string(),
            source,
        })?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    let real = std::fs::read_link(format!("/proc/self/fd/{fd}")).map_err(|source| {
        WorkerFileError::Check {
            path: path.to_string(),
            source,
        }
    })?;
    if !real.starts_with(&root) {
        return Err(WorkerFileError::OutsideTempDir);
    }
    Ok(f)
}

/// A tool handler: JSON in, JSON out; an `Err` becomes an R error with that
/// message.
pub type ToolHandler = Arc<dyn Fn(&ToolCall) -> Result<Value, String> + Send + Sync>;

/// A tool a session offers to its R code.
#[derive(Clone)]
pub struct Tool {
    /// Name, `^[A-Za-z][A-Za-z0-9_.-]*$`.
    pub name: String,
    /// What the tool does (for people and models).
    pub description: String,
    /// JSON schema of the arguments (informative; the handler validates).
    pub schema: Value,
    /// The handler.
    pub handler: ToolHandler,
}

impl fmt::Debug for Tool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tool")
            .field("name", &self.name)
            .field("description", &self.description)
            .finish()
    }
}

impl Tool {
    /// A tool; fails when the name is not `^[A-Za-z][A-Za-z0-9_.-]*$`.
    ///
    /// ```
    /// let t = rvisor::Tool::new("add", "adds two numbers", serde_json::json!({}), |call| {
    ///     let a = call.args["a"].as_f64().ok_or("a must be a number")?;
    ///     let b = call.args["b"].as_f64().ok_or("b must be a number")?;
    ///     Ok(serde_json::json!(a + b))
    /// }).unwrap();
    /// assert_eq!(t.name, "add");
    /// assert!(rvisor::Tool::new("1bad", "", serde_json::json!({}), |_| Ok(serde_json::Value::Null)).is_err());
    /// ```
    pub fn new(
        name: &str,
        description: &str,
        schema: Value,
        handler: impl Fn(&ToolCall) -> Result<Value, String> + Send + Sync + 'static,
    ) -> Result<Self, Error> {
        if !valid_name(name) {
            return Err(Error::Invalid(format!(
                "tool name {name:?} is invalid: it must start with a letter and contain only \
                 letters, digits, '_', '.' and '-'"
            )));
        }
        Ok(Self {
            name: name.to_string(),
            description: description.to_string(),
            schema,
            handler: Arc::new(handler),
        })
    }
}

/// Whether `name` matches `^[A-Za-z][A-Za-z0-9_.-]*$`.
pub fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// What a call needs beyond its options: who is calling, and the tools.
#[derive(Debug, Clone, Default)]
pub struct CallContext {
    /// Session id reported to tool handlers.
    pub session_id: String,
    /// Tools R code may call.
    pub tools: Arc<Vec<Tool>>,
    /// Variables bound before the code runs (checked with
    /// `ops::check_variables`).
    pub variables: Vec<(String, serde_json::Value)>,
    /// Tables bound as data frames: (name, stored Arrow IPC file).
    pub tables: Vec<(String, std::path::PathBuf)>,
    /// Stops the call from another thread: once it runs, the worker's call
    /// loop interrupts it (and kills the worker after the grace period);
    /// cancelled before it was sent, it is not sent and its outcome is
    /// `cancelled`. One-shot runs take it from their caller (see
    /// `Supervisor::run_once_limited`); a session gives each call a token of
    /// its own, which `Session::cancel` and `Session::cancel_call` cancel.
    pub cancel: Option<crate::CancelToken>,
    /// One-shot runs: libraries after R's own on `.libPaths()` for this
    /// run's worker (a tenant's packages, docs/packages.md), read-only when
    /// confined; such a worker is forked for the run, not taken from the
    /// spares. Session calls ignore it: a session's are
    /// `SessionOptions::libpath_after`.
    pub libraries_after: Vec<std::path::PathBuf>,
}

#[cfg(test)]
mod tests {
    #[test]
    fn names() {
        for ok in ["a", "getData", "x_1.v-2"] {
            assert!(super::valid_name(ok), "{ok}");
        }
        for bad in ["", "1a", "_a", "a b", "a$", "é"] {
            assert!(!super::valid_name(bad), "{bad}");
        }
    }
}
