//! Checks of a source tarball before anything is unpacked, from `tar`'s
//! own listing: every entry under one top directory named as the package,
//! no absolute path, no `..`, only files, directories and symbolic links
//! that stay inside the tree (no hard links, devices or fifos), and the
//! unpacked size under a cap.

use std::path::Path;
use std::process::Command;

use crate::PackageError;

/// Checks `tarball` of `package`; returns the unpacked size.
pub fn check(tarball: &Path, package: &str, max_unpacked: u64) -> Result<u64, PackageError> {
    let bad = |detail: String| PackageError::Tarball {
        package: package.into(),
        detail,
    };
    let list = |verbose: bool| -> Result<String, PackageError> {
        let out = Command::new("tar")
            .arg(if verbose { "-tvzf" } else { "-tzf" })
            .arg(tarball)
            .args(["--numeric-owner", "--quoting-style=escape"])
            .env("LC_ALL", "C")
            .output()
            .map_err(PackageError::io("run tar to list a tarball"))?;
        if !out.status.success() {
            return Err(bad(format!(
                "it is not a readable .tar.gz ({})",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let names = list(false)?;
    let long = list(true)?;
    let names: Vec<&str> = names.lines().collect();
    let long: Vec<&str> = long.lines().collect();
    if names.is_empty() || names.len() != long.len() {
        return Err(bad("its listing is empty or inconsistent".into()));
    }
    let mut total: u64 = 0;
    for (name, line) in names.iter().zip(&long) {
        check_path(name, package).map_err(&bad)?;
        let kind = line.chars().next().unwrap_or('?');
        match kind {
            '-' | 'd' => {}
            'l' => {
                let target = line.rsplit(" -> ").next().unwrap_or("");
                check_link(name, target).map_err(&bad)?;
            }
            'h' => return Err(bad(format!("'{name}' is a hard link"))),
            other => {
                return Err(bad(format!(
                    "'{name}' is not a file or directory ({other})"
                )))
            }
        }
        // "-rw-r--r-- 0/0 1234 2024-01-01 00:00 name": the third field.
        let size = line
            .split_whitespace()
            .nth(2)
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0);
        total = total.saturating_add(size);
        if total > max_unpacked {
            return Err(PackageError::Refused {
                package: package.into(),
                rule: "unpacked_bytes",
                detail: format!("its files are larger than the cap of {max_unpacked} bytes"),
            });
        }
    }
    Ok(total)
}

fn check_path(name: &str, package: &str) -> Result<(), String> {
    if name.starts_with('/') {
        return Err(format!("'{name}' is an absolute path"));
    }
    if name.split('/').any(|c| c == "..") {
        return Err(format!("'{name}' leaves the package's directory (..)"));
    }
    let top = name.split('/').next().unwrap_or("");
    if top != package {
        return Err(format!(
            "'{name}' is outside the package's directory '{package}/'"
        ));
    }
    Ok(())
}

/// A symbolic link at `name` pointing at `target` must stay in the tree.
fn check_link(name: &str, target: &str) -> Result<(), String> {
    if target.starts_with('/') {
        return Err(format!("'{name}' links to an absolute path"));
    }
    // Depth of the link's directory below the top, then walk the target.
    let mut depth = name.trim_end_matches('/').split('/').count() as i64 - 1;
    for c in target.split('/') {
        match c {
            ".." => depth -= 1,
            "." | "" => {}
            _ => depth += 1,
        }
        if depth < 1 {
            return Err(format!("'{name}' links out of the package's directory"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_links_must_stay_inside() {
        assert!(check_path("pkg/R/a.R", "pkg").is_ok());
        assert!(check_path("/etc/passwd", "pkg").is_err());
        assert!(check_path("pkg/../x", "pkg").is_err());
        assert!(check_path("other/DESCRIPTION", "pkg").is_err());
        assert!(check_link("pkg/inst/a", "b").is_ok());
        assert!(check_link("pkg/inst/a", "../R/x").is_ok());
        assert!(check_link("pkg/inst/a", "../../x").is_err());
        assert!(check_link("pkg/a", "/etc").is_err());
    }
}
