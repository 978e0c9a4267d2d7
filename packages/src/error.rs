//! The errors of installing packages: one variant per failing step, each
//! message naming what went wrong and what to do.

/// Why an install did not happen. The tenant library is unchanged in
/// every case.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PackageError {
    /// The policy refused a package; `rule` names the rule.
    #[error("package '{package}' is refused by the rule '{rule}': {detail}")]
    Refused {
        /// The package asked for (or a dependency of it).
        package: String,
        /// The rule: `deny`, `allow`, `compiled`, `download_bytes`,
        /// `library_bytes`, `name`.
        rule: &'static str,
        /// What the rule says.
        detail: String,
    },
    /// No allowed repository has the package.
    #[error("package '{package}' is not in any allowed repository ({repos}); check the name or ask the operator to add a repository that has it")]
    Unknown {
        /// The package.
        package: String,
        /// The repositories searched.
        repos: String,
    },
    /// The dependencies form a cycle.
    #[error("the dependencies form a cycle: {}; the repository is inconsistent", cycle.join(" -> "))]
    Cycle {
        /// The packages of the cycle, the first repeated last.
        cycle: Vec<String>,
    },
    /// A repository or its index could not be read.
    #[error("cannot read the repository {repo}: {detail}")]
    Repository {
        /// The repository's URL.
        repo: String,
        /// What failed.
        detail: String,
    },
    /// A download failed or went past its cap.
    #[error("cannot download {url}: {detail}")]
    Download {
        /// What was fetched.
        url: String,
        /// What failed.
        detail: String,
    },
    /// The tarball does not match the index's checksum.
    #[error("the tarball of '{package}' does not match the repository index ({algorithm} {expected} expected, {actual} found): the repository or a proxy changed it; it was not installed")]
    Checksum {
        /// The package.
        package: String,
        /// `MD5sum` or `SHA256`.
        algorithm: &'static str,
        /// From the index.
        expected: String,
        /// Of the downloaded bytes.
        actual: String,
    },
    /// The tarball is unsafe to unpack (absolute or `..` paths, links
    /// out of its tree, devices, too large, not one package directory).
    #[error("the tarball of '{package}' is refused: {detail}")]
    Tarball {
        /// The package.
        package: String,
        /// What is wrong with it.
        detail: String,
    },
    /// `R CMD INSTALL` failed or ran out of time.
    #[error("package '{package}' failed to build: {detail}")]
    Build {
        /// The package.
        package: String,
        /// The reason and the tail of the build's output.
        detail: String,
        /// The build's whole output (bounded).
        log: String,
    },
    /// A file operation on the host failed.
    #[error("failed to {what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl PackageError {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| PackageError::Io { what, source }
    }

    /// A stable code for the wire: `refused`, `unknown_package`,
    /// `dependency_cycle`, `repository`, `download`, `checksum`,
    /// `tarball`, `build_failed`, `io`.
    pub fn code(&self) -> &'static str {
        match self {
            PackageError::Refused { .. } => "refused",
            PackageError::Unknown { .. } => "unknown_package",
            PackageError::Cycle { .. } => "dependency_cycle",
            PackageError::Repository { .. } => "repository",
            PackageError::Download { .. } => "download",
            PackageError::Checksum { .. } => "checksum",
            PackageError::Tarball { .. } => "tarball",
            PackageError::Build { .. } => "build_failed",
            PackageError::Io { .. } => "io",
        }
    }
}
