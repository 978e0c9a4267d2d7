//! A repository's index: `src/contrib/PACKAGES` in R's DCF format (records
//! separated by blank lines, `Field: value`, continuation lines indented),
//! as `tools::write_PACKAGES(type = "source")` writes it.

use crate::Repository;

/// One package of an index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// `Package`.
    pub package: String,
    /// `Version`.
    pub version: String,
    /// Names from `Depends`, `Imports` and `LinkingTo`, without `R` and
    /// version constraints.
    pub dependencies: Vec<String>,
    /// `NeedsCompilation: yes`.
    pub needs_compilation: bool,
    /// `MD5sum`, lower-case hex, when present.
    pub md5: Option<String>,
    /// `SHA256`, lower-case hex, when present.
    pub sha256: Option<String>,
    /// The repository it came from.
    pub repository: Repository,
}

impl Entry {
    /// The tarball's file name in `src/contrib`.
    pub fn tarball(&self) -> String {
        format!("{}_{}.tar.gz", self.package, self.version)
    }
}

/// The records of a DCF text, each as its fields in order.
pub fn parse_dcf(text: &str) -> Vec<Vec<(String, String)>> {
    let mut records = Vec::new();
    let mut cur: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        if line.trim().is_empty() {
            if !cur.is_empty() {
                records.push(std::mem::take(&mut cur));
            }
        } else if line.starts_with([' ', '\t']) {
            if let Some((_, v)) = cur.last_mut() {
                v.push(' ');
                v.push_str(line.trim());
            }
        } else if let Some((k, v)) = line.split_once(':') {
            cur.push((k.trim().into(), v.trim().into()));
        }
    }
    if !cur.is_empty() {
        records.push(cur);
    }
    records
}

/// The package names of a dependency field (`"R (>= 3.5), utils, foo (>=
/// 1.0)"` -> `["utils", "foo"]`).
pub fn dependency_names(field: &str) -> Vec<String> {
    field
        .split(',')
        .map(|d| d.split('(').next().unwrap_or("").trim())
        .filter(|d| !d.is_empty() && *d != "R")
        .map(String::from)
        .collect()
}

/// The entries of one repository's `PACKAGES` text.
pub fn parse(text: &str, repository: &Repository) -> Vec<Entry> {
    parse_dcf(text)
        .into_iter()
        .filter_map(|fields| {
            let get = |k: &str| fields.iter().find(|(f, _)| f == k).map(|(_, v)| v.as_str());
            let package = get("Package")?.to_string();
            let version = get("Version")?.to_string();
            let dependencies = ["Depends", "Imports", "LinkingTo"]
                .iter()
                .filter_map(|f| get(f))
                .flat_map(dependency_names)
                .collect();
            Some(Entry {
                package,
                version,
                dependencies,
                needs_compilation: get("NeedsCompilation").is_some_and(|v| v == "yes"),
                md5: get("MD5sum").map(str::to_ascii_lowercase),
                sha256: get("SHA256").map(str::to_ascii_lowercase),
                repository: repository.clone(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_write_packages_writes() {
        let repo = Repository::parse("file:///r").unwrap();
        let text = "Package: a\nVersion: 1.0\nDepends: R (>= 3.5.0),\n  b (>= 0.1)\nImports: utils\nLinkingTo: c\nNeedsCompilation: yes\nMD5sum: ABCD\n\nPackage: b\nVersion: 0.1\nNeedsCompilation: no\n";
        let e = parse(text, &repo);
        assert_eq!(e.len(), 2);
        assert_eq!(e[0].dependencies, ["b", "utils", "c"]);
        assert!(e[0].needs_compilation);
        assert_eq!(e[0].md5.as_deref(), Some("abcd"));
        assert_eq!(e[0].tarball(), "a_1.0.tar.gz");
        assert!(e[1].dependencies.is_empty() && !e[1].needs_compilation);
    }
}
