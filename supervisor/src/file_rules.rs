//! The rules of a session's files, in one place: which names are allowed
//! (relative, no `..`, no NUL, Unicode NFC, a length cap), which kinds of
//! file leave a worker (regular files only), and the byte and count quotas
//! (per file, per call, per session, per tenant). Every surface and the
//! Rust library check files here; a refusal ([`FileRefusal`]) names the
//! rule it broke and what to do.

use unicode_normalization::UnicodeNormalization;

/// Longest file name, in bytes of UTF-8, slashes included.
pub const MAX_NAME_BYTES: usize = 1024;
/// Longest single component of a name (the common file-system cap).
pub const MAX_COMPONENT_BYTES: usize = 255;
/// Deepest nesting of directories in a name (`a/b/c.csv` is depth 3).
pub const MAX_DEPTH: usize = 16;
/// The prefix of an upload's temporary file, never listed.
pub const UPLOAD_PREFIX: &str = ".rvisor-upload-";

/// The byte and count quotas of files. The service holds one
/// (`ServiceConfig::files`); the Rust library uses [`FileLimits::default`]
/// unless given another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileLimits {
    /// Largest single file, uploaded or downloaded.
    pub max_file_bytes: u64,
    /// Most bytes of files one call may bring in (inputs of a one-shot
    /// run) or send back (its artifacts).
    pub max_call_bytes: u64,
    /// Most bytes of files in one session's working directory (checked
    /// on upload).
    pub max_session_bytes: u64,
    /// Most bytes of files (session files and stored artifacts) of one
    /// tenant (checked by the service).
    pub max_tenant_bytes: u64,
    /// Most files in one session's working directory, and most
    /// artifacts of one call.
    pub max_files: usize,
}

impl Default for FileLimits {
    fn default() -> Self {
        Self {
            max_file_bytes: 256 << 20,
            max_call_bytes: 512 << 20,
            max_session_bytes: 1 << 30,
            max_tenant_bytes: 4 << 30,
            max_files: 1000,
        }
    }
}

/// Why a file was refused: the rule and, in its message, what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileRefusal {
    /// The name breaks a naming rule.
    #[error("file name {name:?} is refused: {why}; use a relative path like `data/input.csv` (no leading `/`, no `.` or `..` parts, no NUL, at most {MAX_NAME_BYTES} bytes)")]
    Name {
        /// The name as given (lossy).
        name: String,
        /// Which rule.
        why: &'static str,
    },
    /// Not a regular file (a symlink, FIFO, device, socket or directory
    /// that R code made): never followed nor read.
    #[error("{name:?} is a {kind}, not a regular file; only regular files are read, written or listed (a symlink, FIFO or device is never followed): have R write the file itself, e.g. file.copy(target, {name:?})")]
    NotRegular {
        /// The name.
        name: String,
        /// What it is.
        kind: &'static str,
    },
    /// A byte quota.
    #[error("{what} is over the limit {limit} of {max} bytes ({size} bytes); {fix}")]
    TooLarge {
        /// What was measured (`the file`, `the session's files`...).
        what: &'static str,
        /// The limit's name (`max_file_bytes`...).
        limit: &'static str,
        /// The limit.
        max: u64,
        /// What it would have been.
        size: u64,
        /// What to do.
        fix: &'static str,
    },
    /// The count of files.
    #[error("the session would hold more than {max} files (limit max_files); delete some first")]
    TooMany {
        /// The limit.
        max: usize,
    },
    /// No such file.
    #[error("no file {name:?} in the session's working directory; list them to see what is there")]
    NotFound {
        /// The name.
        name: String,
    },
}

impl FileRefusal {
    /// Whether this is a tenant or session quota (429) rather than the
    /// size of one request (413).
    pub fn is_quota(&self) -> bool {
        matches!(
            self,
            FileRefusal::TooMany { .. }
                | FileRefusal::TooLarge {
                    limit: "max_session_bytes" | "max_tenant_bytes",
                    ..
                }
        )
    }
}

/// Checks `name` and returns it normalised (NFC), as the file is stored.
pub fn check_name(name: &str) -> Result<String, FileRefusal> {
    let bad = |why| FileRefusal::Name {
        name: name.chars().take(200).collect(),
        why,
    };
    if name.is_empty() {
        return Err(bad("it is empty"));
    }
    if name.contains('\0') {
        return Err(bad("it contains NUL"));
    }
    if name.starts_with('/') {
        return Err(bad("it is an absolute path"));
    }
    if name.contains('\\') {
        return Err(bad("it contains a backslash (use `/` between directories)"));
    }
    if name.chars().any(char::is_control) {
        return Err(bad("it contains a control character"));
    }
    let nfc: String = name.nfc().collect();
    if nfc.len() > MAX_NAME_BYTES {
        return Err(bad("it is too long"));
    }
    let parts: Vec<&str> = nfc.split('/').collect();
    if parts.len() > MAX_DEPTH {
        return Err(bad("it is nested too deep (at most 16 parts)"));
    }
    for p in &parts {
        match *p {
            "" => return Err(bad("it has an empty part (`//` or a trailing `/`)")),
            "." | ".." => return Err(bad("it has a `.` or `..` part")),
            p if p.len() > MAX_COMPONENT_BYTES => {
                return Err(bad("a part is longer than 255 bytes"))
            }
            p if p.starts_with(UPLOAD_PREFIX) => {
                return Err(bad("names starting `.rvisor-upload-` are reserved"))
            }
            _ => {}
        }
    }
    Ok(nfc)
}

/// The kind of a file from its `st_mode`, for refusals and listings.
pub fn kind_of(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "regular file",
        libc::S_IFDIR => "directory",
        libc::S_IFLNK => "symlink",
        libc::S_IFIFO => "FIFO",
        libc::S_IFCHR => "character device",
        libc::S_IFBLK => "block device",
        libc::S_IFSOCK => "socket",
        _ => "special file",
    }
}

/// The media type of a file, from its extension (`application/octet-stream`
/// when unknown).
pub fn media_type(name: &str) -> &'static str {
    let ext = name
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "csv" => "text/csv",
        "tsv" => "text/tab-separated-values",
        "txt" | "log" | "r" | "md" | "rmd" | "qmd" => "text/plain",
        "html" | "htm" => "text/html",
        "json" => "application/json",
        "pdf" => "application/pdf",
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "svg" => "image/svg+xml",
        "gif" => "image/gif",
        "xlsx" => "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
        "xls" => "application/vnd.ms-excel",
        "zip" => "application/zip",
        "gz" => "application/gzip",
        "parquet" => "application/vnd.apache.parquet",
        "arrow" | "feather" => "application/vnd.apache.arrow.file",
        "rds" | "rdata" | "rda" => "application/x-r-data",
        "docx" => "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
        _ => "application/octet-stream",
    }
}

/// Checks a file of `size` bytes against the per-file limit.
pub fn check_file_size(limits: &FileLimits, size: u64) -> Result<(), FileRefusal> {
    if size > limits.max_file_bytes {
        return Err(FileRefusal::TooLarge {
            what: "the file",
            limit: "max_file_bytes",
            max: limits.max_file_bytes,
            size,
            fix: "send a smaller file (split or compress it)",
        });
    }
    Ok(())
}

/// Checks a session's files after a change: `bytes` in `count` files.
pub fn check_session(limits: &FileLimits, bytes: u64, count: usize) -> Result<(), FileRefusal> {
    if count > limits.max_files {
        return Err(FileRefusal::TooMany {
            max: limits.max_files,
        });
    }
    if bytes > limits.max_session_bytes {
        return Err(FileRefusal::TooLarge {
            what: "the session's files",
            limit: "max_session_bytes",
            max: limits.max_session_bytes,
            size: bytes,
            fix: "delete files the session no longer needs",
        });
    }
    Ok(())
}

/// Checks the files one call brings in or sends back: `bytes` in total.
pub fn check_call(limits: &FileLimits, bytes: u64) -> Result<(), FileRefusal> {
    if bytes > limits.max_call_bytes {
        return Err(FileRefusal::TooLarge {
            what: "the call's files",
            limit: "max_call_bytes",
            max: limits.max_call_bytes,
            size: bytes,
            fix: "send or write fewer bytes in one call",
        });
    }
    Ok(())
}

/// Checks a tenant's file bytes after a change.
pub fn check_tenant(limits: &FileLimits, bytes: u64) -> Result<(), FileRefusal> {
    if bytes > limits.max_tenant_bytes {
        return Err(FileRefusal::TooLarge {
            what: "the tenant's files",
            limit: "max_tenant_bytes",
            max: limits.max_tenant_bytes,
            size: bytes,
            fix: "delete files or close sessions you no longer need",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_normalised() {
        assert_eq!(check_name("a/b.csv").unwrap(), "a/b.csv");
        // "é" as e + combining acute becomes the one code point.
        assert_eq!(check_name("cafe\u{301}.csv").unwrap(), "caf\u{e9}.csv");
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../b",
            "./a",
            "a//b",
            "a/",
            "a\0b",
            "a\\b",
            "a\nb",
            ".rvisor-upload-1",
        ] {
            assert!(
                matches!(check_name(bad), Err(FileRefusal::Name { .. })),
                "{bad:?}"
            );
        }
        assert!(check_name(&"x".repeat(256)).is_err());
        assert!(check_name("x/".repeat(17).trim_end_matches('/')).is_err());
        assert!(check_name(&vec!["y".repeat(200); 6].join("/")).is_err());
    }

    #[test]
    fn refusals_name_their_limit() {
        let l = FileLimits {
            max_file_bytes: 10,
            max_session_bytes: 20,
            max_files: 2,
            ..FileLimits::default()
        };
        let e = check_file_size(&l, 11).unwrap_err();
        assert!(e.to_string().contains("max_file_bytes"), "{e}");
        assert!(!e.is_quota());
        let e = check_session(&l, 21, 1).unwrap_err();
        assert!(e.to_string().contains("max_session_bytes"), "{e}");
        assert!(e.is_quota());
        assert!(check_session(&l, 1, 3).unwrap_err().is_quota());
        assert!(check_session(&l, 20, 2).is_ok());
    }

    #[test]
    fn media_types_come_from_extensions() {
        assert_eq!(media_type("fit.RDS"), "application/x-r-data");
        assert_eq!(media_type("out/clean.csv"), "text/csv");
        assert_eq!(media_type("noext"), "application/octet-stream");
    }
}
