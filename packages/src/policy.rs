//! The operator's policy: which repositories, which packages (allow and
//! deny lists), whether code that compiles may be built, and the caps.

use std::collections::BTreeSet;
use std::time::Duration;

use serde::Serialize;

use crate::PackageError;

/// A CRAN-like repository: `file:///dir` or `http(s)://host/path` (a dated
/// snapshot URL works as any other). Its index is
/// `<url>/src/contrib/PACKAGES`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Repository {
    /// The URL, without a trailing slash.
    pub url: String,
}

impl Repository {
    /// A repository from its URL; only `file://`, `http://` and `https://`
    /// are accepted.
    pub fn parse(url: &str) -> Result<Self, String> {
        let url = url.trim().trim_end_matches('/');
        let ok = ["file:///", "http://", "https://"]
            .iter()
            .any(|p| url.starts_with(p) && url.len() > p.len());
        if !ok {
            return Err(format!(
                "repository '{url}' is not a file:///absolute/path or http(s)://host/path URL"
            ));
        }
        Ok(Repository { url: url.into() })
    }

    /// The URL of a file under `src/contrib`.
    pub fn contrib(&self, file: &str) -> String {
        format!("{}/src/contrib/{file}", self.url)
    }
}

/// Default of [`Policy::max_download_bytes`]: 64 MiB per tarball.
pub const DEFAULT_MAX_DOWNLOAD_BYTES: u64 = 64 << 20;
/// Default of [`Policy::max_unpacked_bytes`]: 256 MiB per tarball.
pub const DEFAULT_MAX_UNPACKED_BYTES: u64 = 256 << 20;
/// Default of [`Policy::max_library_bytes`]: 1 GiB per tenant.
pub const DEFAULT_MAX_LIBRARY_BYTES: u64 = 1 << 30;
/// Default of [`Policy::build_timeout`]: 10 minutes per package.
pub const DEFAULT_BUILD_TIMEOUT: Duration = Duration::from_secs(600);

/// What may be installed, from where, within which caps.
#[derive(Debug, Clone, Serialize)]
pub struct Policy {
    /// Repositories, searched in order (the first that has a package
    /// gives it). None: installing is off.
    pub repositories: Vec<Repository>,
    /// Only these packages (and none other, dependencies included) when
    /// set.
    pub allow: Option<BTreeSet<String>>,
    /// Never these packages, even as a dependency.
    pub deny: BTreeSet<String>,
    /// Whether packages that compile code (`NeedsCompilation: yes`) may be
    /// built (default true).
    pub compiled: bool,
    /// Most bytes of one downloaded tarball.
    pub max_download_bytes: u64,
    /// Most bytes of one tarball's files once unpacked.
    pub max_unpacked_bytes: u64,
    /// Most bytes of one tenant's library.
    pub max_library_bytes: u64,
    /// Longest one package's build may take.
    #[serde(serialize_with = "secs")]
    pub build_timeout: Duration,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(d.as_secs())
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            repositories: Vec::new(),
            allow: None,
            deny: BTreeSet::new(),
            compiled: true,
            max_download_bytes: DEFAULT_MAX_DOWNLOAD_BYTES,
            max_unpacked_bytes: DEFAULT_MAX_UNPACKED_BYTES,
            max_library_bytes: DEFAULT_MAX_LIBRARY_BYTES,
            build_timeout: DEFAULT_BUILD_TIMEOUT,
        }
    }
}

/// Whether `name` is a valid R package name (letters, digits, `.`; starts
/// with a letter, does not end with `.`, at least two characters).
pub fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() >= 2
        && b.len() <= 100
        && b[0].is_ascii_alphabetic()
        && b[b.len() - 1] != b'.'
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'.')
}

impl Policy {
    /// Checks one name against the lists (not the compiled rule, which
    /// needs the index).
    pub fn check_name(&self, name: &str) -> Result<(), PackageError> {
        let refuse = |rule, detail: String| PackageError::Refused {
            package: name.into(),
            rule,
            detail,
        };
        if !valid_name(name) {
            return Err(refuse(
                "name",
                "not a valid R package name (letters, digits and '.', starting with a letter)"
                    .into(),
            ));
        }
        if self.deny.contains(name) {
            return Err(refuse("deny", "the operator's deny-list names it".into()));
        }
        if let Some(allow) = &self.allow {
            if !allow.contains(name) {
                return Err(refuse(
                    "allow",
                    "the operator's allow-list does not name it (dependencies must be allowed too)"
                        .into(),
                ));
            }
        }
        Ok(())
    }

    /// Checks whether a package that `needs_compilation` may be built.
    pub fn check_compiled(&self, name: &str, needs_compilation: bool) -> Result<(), PackageError> {
        if needs_compilation && !self.compiled {
            return Err(PackageError::Refused {
                package: name.into(),
                rule: "compiled",
                detail: "it compiles code and the operator allows pure-R packages only".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repositories_must_be_file_or_http() {
        assert!(Repository::parse("file:///srv/cran/").is_ok());
        assert_eq!(
            Repository::parse("https://example.org/snap/2024-01-01/")
                .unwrap()
                .url,
            "https://example.org/snap/2024-01-01"
        );
        assert!(Repository::parse("ftp://x").is_err());
        assert!(Repository::parse("file://relative").is_err());
        assert!(Repository::parse("http://").is_err());
    }

    #[test]
    fn lists_name_their_rule() {
        let mut p = Policy::default();
        p.deny.insert("evil".into());
        let rule = |r: Result<(), PackageError>| match r {
            Err(PackageError::Refused { rule, .. }) => rule,
            other => panic!("{other:?}"),
        };
        assert_eq!(rule(p.check_name("evil")), "deny");
        assert_eq!(rule(p.check_name("../x")), "name");
        assert!(p.check_name("janitor").is_ok());
        p.allow = Some(["janitor".to_string()].into());
        assert_eq!(rule(p.check_name("dplyr")), "allow");
        p.compiled = false;
        assert_eq!(rule(p.check_compiled("x", true)), "compiled");
        assert!(p.check_compiled("x", false).is_ok());
    }
}
