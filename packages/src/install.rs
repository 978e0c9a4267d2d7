//! The installer: the whole flow for one tenant, with a library per
//! tenant under the state directory, a manifest of what was installed
//! from where, and a staging library renamed into place only when every
//! package of the request is ready.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::build::{self, BuildSettings};
use crate::cache::{self, BuildKey, Cache};
use crate::confine::BuilderSandbox;
use crate::index::{self, Entry};
use crate::{fetch, resolve, tarball, PackageError, Policy};

/// Most bytes of one repository index.
const MAX_INDEX_BYTES: u64 = 64 << 20;

/// One installed package, as an install answers and the manifest keeps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Installed {
    /// Package name.
    pub name: String,
    /// Version.
    pub version: String,
    /// The repository URL it came from.
    pub repository: String,
    /// Whether the build came from the cache (built before, for this or
    /// another tenant) rather than `R CMD INSTALL`.
    pub cached: bool,
    /// Whether it was asked for (false: pulled in as a dependency).
    pub requested: bool,
    /// SHA-256 of the source tarball it was built from (lockfiles check
    /// it); absent in manifests written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// A tenant library as a lockfile: what to install, exactly, to make it
/// again (`Installer::lockfile`, `Installer::install_lockfile`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lockfile {
    /// The format's version (1).
    pub lockfile_version: u32,
    /// R's `major.minor` the packages were built for.
    #[serde(default)]
    pub r_version: String,
    /// R's platform.
    #[serde(default)]
    pub platform: String,
    /// The packages, dependencies before what needs them.
    pub packages: Vec<LockedPackage>,
}

/// One package of a [`Lockfile`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockedPackage {
    /// Package name.
    pub name: String,
    /// The exact version.
    pub version: String,
    /// The repository it came from.
    #[serde(default)]
    pub repository: String,
    /// SHA-256 of its source tarball; checked when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// Most packages one lockfile may name.
pub const MAX_LOCKED_PACKAGES: usize = 1000;

/// The R that builds: its program, version, platform, and the packages
/// its own libraries have (base, recommended, site).
#[derive(Debug, Clone)]
pub struct RInfo {
    /// The `R` program.
    pub r: PathBuf,
    /// `major.minor`.
    pub version: String,
    /// `R.version$platform`.
    pub platform: String,
    /// Packages in R's libraries (never installed into a tenant's).
    pub site_packages: BTreeSet<String>,
    /// R's home and libraries (`R.home()`, `.libPaths()`), which a build
    /// reads.
    pub dirs: Vec<PathBuf>,
}

impl RInfo {
    /// Asks `r` (with `libpath` as `R_LIBS`, the site libraries sessions
    /// see) for its version, platform and installed packages.
    pub fn probe(r: &Path, libpath: &[PathBuf]) -> Result<Self, PackageError> {
        let mut c = Command::new(r);
        c.args(["--vanilla", "-s", "-e"]).arg(
            "cat(paste(R.version$major, R.version$minor, sep='.'), R.version$platform, paste(c(R.home(), .libPaths()), collapse='\\t'), rownames(installed.packages()), sep='\\n')",
        );
        if !libpath.is_empty() {
            if let Ok(j) = std::env::join_paths(libpath) {
                c.env("R_LIBS", j);
            }
        }
        let out = c
            .output()
            .map_err(PackageError::io(format!("run {}", r.display())))?;
        if !out.status.success() {
            return Err(PackageError::Io {
                what: format!("ask {} for its version", r.display()),
                source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).into_owned()),
            });
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let mut lines = text.lines();
        Ok(RInfo {
            r: r.into(),
            version: lines.next().unwrap_or("").into(),
            platform: lines.next().unwrap_or("").into(),
            dirs: lines
                .next()
                .unwrap_or("")
                .split('\t')
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .collect(),
            site_packages: lines.map(String::from).collect(),
        })
    }
}

/// Installs packages for tenants. One per server; cheap to share.
#[derive(Debug)]
pub struct Installer {
    policy: Policy,
    root: PathBuf,
    r: RInfo,
    cache: Cache,
    locks: Mutex<BTreeMap<String, Arc<Mutex<()>>>>,
}

impl Installer {
    /// An installer keeping tenant libraries and the build cache under
    /// `root` (`tenants/<tenant>/library`, `cache/`).
    pub fn new(policy: Policy, root: PathBuf, r: RInfo) -> Self {
        let cache = Cache::new(root.join("cache"));
        Installer {
            policy,
            root,
            r,
            cache,
            locks: Mutex::new(BTreeMap::new()),
        }
    }

    /// The lock that orders one tenant's changes to its library (an
    /// install, a lockfile, taking builds from the shared store).
    fn tenant_lock(&self, tenant: &str) -> Arc<Mutex<()>> {
        let mut m = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        m.entry(tenant.into()).or_default().clone()
    }

    /// The policy in force.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// What the builder's confinement enforces here.
    pub fn builder_sandbox(&self) -> BuilderSandbox {
        BuilderSandbox::here()
    }

    fn tenant_dir(&self, tenant: &str) -> PathBuf {
        // Tenant names are the service's (checked there); hex keeps any
        // name a single safe path component.
        let hexname: String = tenant.bytes().map(|b| format!("{b:02x}")).collect();
        self.root.join("tenants").join(hexname)
    }

    /// The tenant's library directory (may not exist yet).
    pub fn library(&self, tenant: &str) -> PathBuf {
        self.tenant_dir(tenant).join("library")
    }

    /// What the tenant has installed, from its manifest.
    pub fn installed(&self, tenant: &str) -> Vec<Installed> {
        let p = self.tenant_dir(tenant).join("manifest.json");
        std::fs::read(p)
            .ok()
            .and_then(|b| serde_json::from_slice::<Vec<Installed>>(&b).ok())
            .unwrap_or_default()
    }

    fn index(&self) -> Result<BTreeMap<String, Entry>, PackageError> {
        let mut all = BTreeMap::new();
        for repo in &self.policy.repositories {
            let url = repo.contrib("PACKAGES");
            let bytes = fetch::fetch_bytes(&url, MAX_INDEX_BYTES).map_err(|e| {
                PackageError::Repository {
                    repo: repo.url.clone(),
                    detail: e.to_string(),
                }
            })?;
            for e in index::parse(&String::from_utf8_lossy(&bytes), repo) {
                all.entry(e.package.clone()).or_insert(e);
            }
        }
        Ok(all)
    }

    /// Installs `names` and what they need into `tenant`'s library. On
    /// any error the library is as it was.
    pub fn install(&self, tenant: &str, names: &[String]) -> Result<Vec<Installed>, PackageError> {
        if self.policy.repositories.is_empty() {
            return Err(PackageError::Refused {
                package: names.join(", "),
                rule: "repositories",
                detail: "no package repository is configured (rvisor serve --package-repo URL)"
                    .into(),
            });
        }
        for n in names {
            self.policy.check_name(n)?;
        }
        let lock = self.tenant_lock(tenant);
        let _held = lock.lock().unwrap_or_else(|e| e.into_inner());
        let index = self.index()?;
        let lib = self.library(tenant);
        let has =
            |n: &str| self.r.site_packages.contains(n) || lib.join(n).join("DESCRIPTION").is_file();
        let repos: Vec<&str> = self
            .policy
            .repositories
            .iter()
            .map(|r| r.url.as_str())
            .collect();
        let plan = resolve::resolve(names, &index, &has, &self.policy, &repos.join(", "))?;
        self.apply(tenant, plan, names)
    }

    /// Installs exactly what `lock` names, in its order, into `tenant`'s
    /// library: each package at its locked version from the repositories'
    /// index (a dated snapshot repository keeps old versions), its tarball
    /// checked against the lockfile's SHA-256 when it has one. On any
    /// error the library is as it was.
    pub fn install_lockfile(
        &self,
        tenant: &str,
        lock: &Lockfile,
    ) -> Result<Vec<Installed>, PackageError> {
        let names: Vec<String> = lock.packages.iter().map(|p| p.name.clone()).collect();
        let refused = |package: &str, rule: &'static str, detail: String| PackageError::Refused {
            package: package.into(),
            rule,
            detail,
        };
        if lock.lockfile_version != 1 {
            return Err(refused(
                &names.join(", "),
                "lockfile",
                format!(
                    "lockfile_version {} is not known here (1 is)",
                    lock.lockfile_version
                ),
            ));
        }
        if lock.packages.len() > MAX_LOCKED_PACKAGES {
            return Err(refused(
                "",
                "lockfile",
                format!(
                    "{} packages, more than the {MAX_LOCKED_PACKAGES} a lockfile may name",
                    lock.packages.len()
                ),
            ));
        }
        if self.policy.repositories.is_empty() {
            return Err(refused(
                &names.join(", "),
                "repositories",
                "no package repository is configured (rvisor serve --package-repo URL)".into(),
            ));
        }
        for n in &names {
            self.policy.check_name(n)?;
        }
        let held = self.tenant_lock(tenant);
        let _held = held.lock().unwrap_or_else(|e| e.into_inner());
        let index = self.index()?;
        let repos: Vec<&str> = self
            .policy
            .repositories
            .iter()
            .map(|r| r.url.as_str())
            .collect();
        let mut plan = Vec::new();
        for p in &lock.packages {
            if self.r.site_packages.contains(&p.name) {
                continue;
            }
            let Some(e) = index.get(&p.name) else {
                return Err(PackageError::Unknown {
                    package: p.name.clone(),
                    repos: repos.join(", "),
                });
            };
            if e.version != p.version {
                return Err(refused(
                    &p.name,
                    "lockfile",
                    format!(
                        "the lockfile has version {}, the repositories have {}: point \
                         --package-repo at the dated snapshot the lockfile was made from",
                        p.version, e.version
                    ),
                ));
            }
            self.policy.check_compiled(&p.name, e.needs_compilation)?;
            let mut e = e.clone();
            if let Some(sha) = &p.sha256 {
                // The lockfile's digest is the one that counts.
                e.sha256 = Some(sha.to_ascii_lowercase());
            }
            plan.push(e);
        }
        self.apply(tenant, plan, &names)
    }

    /// The tenant's library as a lockfile: its packages in an order that
    /// puts each after the packages of the library it needs.
    pub fn lockfile(&self, tenant: &str) -> Lockfile {
        let manifest = self.installed(tenant);
        let lib = self.library(tenant);
        let deps = |name: &str| -> Vec<String> {
            let text =
                std::fs::read_to_string(lib.join(name).join("DESCRIPTION")).unwrap_or_default();
            index::parse_dcf(&text)
                .into_iter()
                .next()
                .unwrap_or_default()
                .into_iter()
                .filter(|(k, _)| matches!(k.as_str(), "Depends" | "Imports" | "LinkingTo"))
                .flat_map(|(_, v)| index::dependency_names(&v))
                .collect()
        };
        let mut order: Vec<LockedPackage> = Vec::new();
        let mut seen = BTreeSet::new();
        fn visit(
            name: &str,
            manifest: &[Installed],
            deps: &dyn Fn(&str) -> Vec<String>,
            seen: &mut BTreeSet<String>,
            order: &mut Vec<LockedPackage>,
        ) {
            let Some(m) = manifest.iter().find(|m| m.name == name) else {
                return;
            };
            if !seen.insert(name.to_string()) {
                return;
            }
            for d in deps(name) {
                visit(&d, manifest, deps, seen, order);
            }
            order.push(LockedPackage {
                name: m.name.clone(),
                version: m.version.clone(),
                repository: m.repository.clone(),
                sha256: m.sha256.clone(),
            });
        }
        for m in &manifest {
            visit(&m.name, &manifest, &deps, &mut seen, &mut order);
        }
        Lockfile {
            lockfile_version: 1,
            r_version: self.r.version.clone(),
            platform: self.r.platform.clone(),
            packages: order,
        }
    }

    /// Stages `plan` (what is there already at its version left out),
    /// checks the library cap, renames it into place and records it in
    /// the manifest. The caller holds the tenant's lock.
    fn apply(
        &self,
        tenant: &str,
        plan: Vec<Entry>,
        names: &[String],
    ) -> Result<Vec<Installed>, PackageError> {
        let lib = self.library(tenant);
        let manifest = self.installed(tenant);
        let current = |n: &str| {
            manifest
                .iter()
                .find(|i| i.name == n)
                .map(|i| i.version.clone())
        };
        // Already there at the planned version: nothing to do.
        let plan: Vec<Entry> = plan
            .into_iter()
            .filter(|e| {
                current(&e.package).as_deref() != Some(e.version.as_str())
                    || !lib.join(&e.package).is_dir()
            })
            .collect();
        let dir = self.tenant_dir(tenant);
        let staging = dir.join(format!("staging-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging)
            .map_err(PackageError::io("create the staging library"))?;
        let result = self.stage(&plan, &staging, &lib, names);
        let done = result.and_then(|done| {
            let used = cache::tree_bytes(&lib) + cache::tree_bytes(&staging);
            if used > self.policy.max_library_bytes {
                return Err(PackageError::Refused {
                    package: names.join(", "),
                    rule: "library_bytes",
                    detail: format!(
                        "the tenant library would hold {used} bytes, over the cap of {}",
                        self.policy.max_library_bytes
                    ),
                });
            }
            self.commit(&staging, &lib, &done)?;
            Ok(done)
        });
        let _ = std::fs::remove_dir_all(&staging);
        let done = done?;
        self.record(tenant, &done)?;
        Ok(done)
    }

    /// The name under which another node finds the build of `p` (a
    /// package of a tenant's manifest): its R version, platform, name,
    /// version and tarball SHA-256. `None` for entries without a digest.
    pub fn build_name(&self, p: &Installed) -> Option<String> {
        let sha = p.sha256.as_deref()?;
        Some(format!(
            "{}/{}/{}_{}_{sha}.tar.gz",
            self.r.version, self.r.platform, p.name, p.version
        ))
    }

    /// Writes the built tree of `name` in `tenant`'s library to `dst` as
    /// a gzipped tar (one top directory, the package's), for the shared
    /// store.
    pub fn pack(&self, tenant: &str, name: &str, dst: &Path) -> Result<(), PackageError> {
        let out = Command::new("tar")
            .arg("-czf")
            .arg(dst)
            .arg("-C")
            .arg(self.library(tenant))
            .arg(name)
            .output()
            .map_err(PackageError::io("run tar to pack a built package"))?;
        if !out.status.success() {
            return Err(PackageError::Io {
                what: format!("pack the build of {name}"),
                source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).into_owned()),
            });
        }
        Ok(())
    }

    /// Takes into `tenant`'s library the packages of `remote` (a manifest
    /// another node wrote) it does not have at their versions, from their
    /// packed builds: `fetch(entry, path)` writes the pack to `path`
    /// (false: not there). Each pack is checked as a tarball is, unpacked
    /// into staging, renamed into place with the others, and kept in this
    /// node's build cache; nothing is built. On any error the library is
    /// as it was. Returns what was taken.
    pub fn adopt(
        &self,
        tenant: &str,
        remote: &[Installed],
        fetch: &dyn Fn(&Installed, &Path) -> Result<bool, String>,
    ) -> Result<Vec<Installed>, PackageError> {
        let lock = self.tenant_lock(tenant);
        let _held = lock.lock().unwrap_or_else(|e| e.into_inner());
        let lib = self.library(tenant);
        let mine = self.installed(tenant);
        let missing: Vec<&Installed> = remote
            .iter()
            .filter(|r| {
                crate::policy::valid_name(&r.name)
                    && !(mine
                        .iter()
                        .any(|m| m.name == r.name && m.version == r.version)
                        && lib.join(&r.name).is_dir())
            })
            .collect();
        if missing.is_empty() {
            return Ok(Vec::new());
        }
        let dir = self.tenant_dir(tenant);
        let staging = dir.join(format!("adopt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging)
            .map_err(PackageError::io("create the staging library"))?;
        let result = (|| {
            let mut done = Vec::new();
            for r in missing {
                let Some(sha) = r.sha256.clone() else {
                    continue;
                };
                let pack = staging.join(format!(".{}.tar.gz", r.name));
                let found = fetch(r, &pack).map_err(|detail| PackageError::Download {
                    url: format!("the shared store's build of {} {}", r.name, r.version),
                    detail,
                })?;
                if !found {
                    continue;
                }
                tarball::check(&pack, &r.name, self.policy.max_unpacked_bytes)?;
                let out = Command::new("tar")
                    .args(["-xzf"])
                    .arg(&pack)
                    .arg("-C")
                    .arg(&staging)
                    .args(["--no-same-owner", "--no-same-permissions"])
                    .output()
                    .map_err(PackageError::io("run tar to unpack a built package"))?;
                let _ = std::fs::remove_file(&pack);
                if !out.status.success() {
                    return Err(PackageError::Tarball {
                        package: r.name.clone(),
                        detail: String::from_utf8_lossy(&out.stderr).into_owned(),
                    });
                }
                // Readable by the workers' uids whatever this process's
                // umask, writable by none of them, no set-id bits.
                let _ = Command::new("chmod")
                    .args(["-R", "u+rwX,go+rX,go-w,ug-s"])
                    .arg(staging.join(&r.name))
                    .status();
                let key = BuildKey {
                    package: r.name.clone(),
                    version: r.version.clone(),
                    r_version: self.r.version.clone(),
                    platform: self.r.platform.clone(),
                    sha256: sha,
                };
                self.cache.put(&key, &staging.join(&r.name))?;
                done.push(Installed {
                    cached: true,
                    ..r.clone()
                });
            }
            Ok(done)
        })();
        let done = result.and_then(|done| {
            self.commit(&staging, &lib, &done)?;
            Ok(done)
        });
        let _ = std::fs::remove_dir_all(&staging);
        let done = done?;
        self.record(tenant, &done)?;
        Ok(done)
    }

    /// Merges `done` into the tenant's manifest.
    fn record(&self, tenant: &str, done: &[Installed]) -> Result<(), PackageError> {
        let dir = self.tenant_dir(tenant);
        let mut manifest = self.installed(tenant);
        for d in done {
            manifest.retain(|m| m.name != d.name);
            manifest.push(d.clone());
        }
        manifest.sort_by(|a, b| a.name.cmp(&b.name));
        let tmp = dir.join("manifest.json.tmp");
        let body = serde_json::to_vec_pretty(&manifest).map_err(|e| PackageError::Io {
            what: "write the manifest".into(),
            source: std::io::Error::other(e),
        })?;
        std::fs::write(&tmp, body).map_err(PackageError::io("write the manifest"))?;
        std::fs::rename(&tmp, dir.join("manifest.json"))
            .map_err(PackageError::io("write the manifest"))
    }

    /// Builds (or takes from the cache) every entry into `staging`.
    fn stage(
        &self,
        plan: &[Entry],
        staging: &Path,
        lib: &Path,
        names: &[String],
    ) -> Result<Vec<Installed>, PackageError> {
        let scratch = staging.join(".build");
        let mut done = Vec::new();
        for e in plan {
            let tar = scratch.join(e.tarball());
            std::fs::create_dir_all(&scratch)
                .map_err(PackageError::io("create the build's directory"))?;
            fetch::fetch_to(
                &e.repository.contrib(&e.tarball()),
                &tar,
                self.policy.max_download_bytes,
            )?;
            let (md5, sha) = fetch::digests(&tar)?;
            let (algorithm, expected, actual) = match (&e.sha256, &e.md5) {
                (Some(s), _) => ("SHA256", s.clone(), sha.clone()),
                (None, Some(m)) => ("MD5sum", m.clone(), md5),
                (None, None) => {
                    return Err(PackageError::Refused {
                        package: e.package.clone(),
                        rule: "checksum",
                        detail: "the repository index gives no MD5sum or SHA256 for it (write the index with tools::write_PACKAGES)".into(),
                    })
                }
            };
            if expected != actual {
                return Err(PackageError::Checksum {
                    package: e.package.clone(),
                    algorithm,
                    expected,
                    actual,
                });
            }
            let key = BuildKey {
                package: e.package.clone(),
                version: e.version.clone(),
                r_version: self.r.version.clone(),
                platform: self.r.platform.clone(),
                sha256: sha.clone(),
            };
            let cached = match self.cache.get(&key) {
                Some(built) => {
                    cache::link_tree(&built, &staging.join(&e.package))?;
                    true
                }
                None => {
                    tarball::check(&tar, &e.package, self.policy.max_unpacked_bytes)?;
                    let s = BuildSettings {
                        r: self.r.r.clone(),
                        timeout: self.policy.build_timeout,
                        libraries: vec![lib.to_path_buf()],
                        r_dirs: self.r.dirs.clone(),
                    };
                    build::install(&s, &e.package, &tar, staging, &scratch.join(&e.package))?;
                    self.cache.put(&key, &staging.join(&e.package))?;
                    false
                }
            };
            done.push(Installed {
                name: e.package.clone(),
                version: e.version.clone(),
                repository: e.repository.url.clone(),
                cached,
                requested: names.contains(&e.package),
                sha256: Some(sha),
            });
        }
        Ok(done)
    }

    /// Renames every staged package into the library (an older version
    /// moved aside first and removed after).
    fn commit(&self, staging: &Path, lib: &Path, done: &[Installed]) -> Result<(), PackageError> {
        std::fs::create_dir_all(lib).map_err(PackageError::io("create the tenant library"))?;
        for d in done {
            let (new, at) = (staging.join(&d.name), lib.join(&d.name));
            let old = staging.join(format!(".old-{}", d.name));
            if at.exists() {
                std::fs::rename(&at, &old)
                    .map_err(PackageError::io("move an older version aside"))?;
            }
            std::fs::rename(&new, &at)
                .map_err(PackageError::io("move a package into the tenant library"))?;
        }
        Ok(())
    }
}
