//! The build cache: built packages keyed by (package, version, R version,
//! platform, tarball SHA-256), shared by every tenant of a node. A tenant
//! gets a cached package as hard links (a copy where links cannot be
//! made), never by building it again.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::PackageError;

/// What identifies one build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildKey {
    /// Package name.
    pub package: String,
    /// Its version.
    pub version: String,
    /// `R.version$major.minor`.
    pub r_version: String,
    /// `R.version$platform`.
    pub platform: String,
    /// SHA-256 of the tarball built.
    pub sha256: String,
}

impl BuildKey {
    /// The entry's directory name: readable, then a digest of the whole key.
    pub fn dir_name(&self) -> String {
        let mut h = Sha256::new();
        for part in [
            &self.package,
            &self.version,
            &self.r_version,
            &self.platform,
            &self.sha256,
        ] {
            h.update(part.as_bytes());
            h.update([0]);
        }
        let d: String = h
            .finalize()
            .iter()
            .take(12)
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("{}_{}-{d}", self.package, self.version)
    }
}

/// The cache directory.
#[derive(Debug, Clone)]
pub struct Cache {
    root: PathBuf,
}

impl Cache {
    /// A cache in `root` (created when first written).
    pub fn new(root: PathBuf) -> Self {
        Cache { root }
    }

    /// The built package directory of `key`, if cached.
    pub fn get(&self, key: &BuildKey) -> Option<PathBuf> {
        let p = self.root.join(key.dir_name()).join(&key.package);
        p.join("DESCRIPTION").is_file().then_some(p)
    }

    /// Puts the built package at `built` (a directory named as the
    /// package) in the cache: copied beside, then renamed into place, so
    /// a reader never sees half an entry.
    pub fn put(&self, key: &BuildKey, built: &Path) -> Result<(), PackageError> {
        if self.get(key).is_some() {
            return Ok(());
        }
        std::fs::create_dir_all(&self.root).map_err(PackageError::io("create the build cache"))?;
        let tmp = self
            .root
            .join(format!(".tmp-{}-{}", std::process::id(), key.dir_name()));
        let _ = std::fs::remove_dir_all(&tmp);
        link_tree(built, &tmp.join(&key.package))?;
        match std::fs::rename(&tmp, self.root.join(key.dir_name())) {
            Ok(()) => Ok(()),
            // Another install put the same build first: keep that one.
            Err(_) if self.get(key).is_some() => {
                let _ = std::fs::remove_dir_all(&tmp);
                Ok(())
            }
            Err(e) => Err(PackageError::io("put a build in the cache")(e)),
        }
    }
}

/// Recreates the tree at `from` at `to`: directories made, files hard
/// linked (copied when a link cannot be made), symbolic links recreated.
pub fn link_tree(from: &Path, to: &Path) -> Result<(), PackageError> {
    std::fs::create_dir_all(to).map_err(PackageError::io(format!("create {}", to.display())))?;
    let rd =
        std::fs::read_dir(from).map_err(PackageError::io(format!("read {}", from.display())))?;
    for e in rd {
        let e = e.map_err(PackageError::io(format!("read {}", from.display())))?;
        let (src, dst) = (e.path(), to.join(e.file_name()));
        let ft = e
            .file_type()
            .map_err(PackageError::io(format!("stat {}", src.display())))?;
        if ft.is_dir() {
            link_tree(&src, &dst)?;
        } else if ft.is_symlink() {
            let t = std::fs::read_link(&src)
                .map_err(PackageError::io(format!("read {}", src.display())))?;
            std::os::unix::fs::symlink(t, &dst)
                .map_err(PackageError::io(format!("link {}", dst.display())))?;
        } else if std::fs::hard_link(&src, &dst).is_err() {
            std::fs::copy(&src, &dst)
                .map_err(PackageError::io(format!("copy {}", src.display())))?;
        }
    }
    Ok(())
}

/// Bytes of the files under `dir` (0 when absent).
pub fn tree_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => tree_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map(|m| m.len()).unwrap_or(0),
            _ => 0,
        })
        .sum()
}
