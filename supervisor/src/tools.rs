//! Host tools that R code calls as `tools$name(...)` during a call.

use crate::Error;
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
}

/// Reads a file that R code wrote and named in a tool call, refusing any
/// path outside the calling worker's temporary directory (R code is
/// untrusted: it must not make the host read files for it). The check is
/// made on the opened file (no symlink as the last component, and the real
/// path of the descriptor), so swapping the path after the check does not
/// help.
pub fn read_worker_file(call: &ToolCall, path: &str) -> Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let root = std::fs::canonicalize(&call.worker_temp_dir)
        .map_err(|e| format!("the worker's directory is gone: {e}"))?;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| format!("cannot open {path}: {e}"))?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    let real = std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .map_err(|e| format!("cannot check {path}: {e}"))?;
    if !real.starts_with(&root) {
        return Err("the file must be in the R session's temporary directory (tempdir())".into());
    }
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {path}: {e}"))?;
    Ok(bytes)
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
    /// [`crate::ops::check_variables`]).
    pub variables: Vec<(String, serde_json::Value)>,
    /// Tables bound as data frames: (name, stored Arrow IPC file).
    pub tables: Vec<(String, std::path::PathBuf)>,
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
