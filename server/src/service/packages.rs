//! Packages on demand (docs/packages.md): the service's side of
//! `rvisor-packages`, one definition for every surface.
//!
//! With an installer configured, every call of a tenant (its sessions and
//! its one-shot runs) has the tenant's library after R's own on
//! `.libPaths()`, read-only to the worker; R code's `install.packages()`
//! asks the `rvisor.install` host tool, and `POST /v1/packages/install`
//! (MCP `install_r_packages`, nng `install_packages`) comes to
//! [`Service::install_packages`]. Both install through the installer, on
//! the host: the worker never gets network.

use super::{lock, ErrorCode, Service, ServiceError};
use rvisor_packages::{Installed, Installer, PackageError};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a node compares a tenant's library with the shared store's
/// manifest (on the tenant's calls, at most once per this long).
pub const SYNC_EVERY: Duration = Duration::from_secs(5);

/// The tenant's manifest in the shared store.
fn manifest_key(tenant: &str) -> String {
    format!(
        "packages/tenants/{}/manifest.json",
        crate::blob::tenant_key(tenant)
    )
}

/// Tries of [`merge_manifest`] before it gives up (each a read and a
/// conditional write; another node's write in between means one more).
const MERGE_TRIES: usize = 16;

/// Puts `mine` (this node's view of a tenant's library) into the shared
/// store's manifest at `key`: the store's entries with this node's over
/// them, written only if no other node wrote in between (compare and
/// swap on the e-tag; retried on a conflict), so two nodes installing for
/// one tenant at once both keep their packages. `between` runs after each
/// read (tests put another node's write there).
fn merge_manifest(
    store: &crate::blob::BlobStore,
    key: &str,
    mine: &[Installed],
    mut between: impl FnMut(),
) -> Result<(), String> {
    use crate::blob::BlobError;
    for _ in 0..MERGE_TRIES {
        let current = store.get(key).map_err(|e| e.to_string())?;
        let mut manifest: Vec<Installed> = current
            .as_ref()
            .and_then(|b| serde_json::from_slice(&b.bytes).ok())
            .unwrap_or_default();
        for m in mine {
            manifest.retain(|x| x.name != m.name);
            manifest.push(m.clone());
        }
        manifest.sort_by(|a, b| a.name.cmp(&b.name));
        let body = serde_json::to_vec(&manifest).map_err(|e| e.to_string())?;
        between();
        let put = match current.and_then(|b| b.e_tag) {
            Some(tag) => store.put_if_match(key, body, &tag),
            None => store.put_if_absent(key, body),
        };
        match put {
            Ok(_) => return Ok(()),
            Err(BlobError::Changed(_) | BlobError::Exists(_)) => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
    Err(format!(
        "the manifest changed under every one of {MERGE_TRIES} tries"
    ))
}

/// Most packages one install request may name.
pub const MAX_PACKAGES_PER_INSTALL: usize = 100;

/// The name of the host tool behind R's `install.packages()`.
pub const INSTALL_TOOL: &str = "rvisor.install";

/// A package error as every surface reports it: code `package`, the
/// installer's message, and `details` with the step (`reason`: `refused`,
/// `unknown_package`, `dependency_cycle`, `repository`, `download`,
/// `checksum`, `tarball`, `build_failed`, `io`), the package and rule
/// where there is one, and the tail of a failed build's log.
pub fn package_error(e: &PackageError) -> ServiceError {
    let mut details = json!({"reason": e.code()});
    match e {
        PackageError::Refused { package, rule, .. } => {
            details["package"] = json!(package);
            details["rule"] = json!(rule);
        }
        PackageError::Unknown { package, .. }
        | PackageError::Checksum { package, .. }
        | PackageError::Tarball { package, .. } => details["package"] = json!(package),
        PackageError::Build { package, log, .. } => {
            details["package"] = json!(package);
            details["log"] = json!(log_tail(log, 8 << 10));
        }
        PackageError::Cycle { cycle } => details["cycle"] = json!(cycle),
        _ => {}
    }
    let mut err = ServiceError::new(ErrorCode::Package, e.to_string());
    err.details = Some(details);
    err
}

/// The last `max` bytes of `log` (at a character boundary).
fn log_tail(log: &str, max: usize) -> &str {
    if log.len() <= max {
        return log;
    }
    let mut start = log.len() - max;
    while !log.is_char_boundary(start) {
        start += 1;
    }
    &log[start..]
}

/// Package names from a request: a string or an array of strings,
/// one at least and at most [`MAX_PACKAGES_PER_INSTALL`].
pub fn package_names(v: &Value) -> Result<Vec<String>, ServiceError> {
    let names: Vec<String> = match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                ServiceError::invalid(
                    "`packages` must be package names (strings), e.g. [\"janitor\"]",
                )
            })?,
        _ => {
            return Err(ServiceError::invalid(
                "`packages` must be a package name or a list of names, e.g. [\"janitor\"]",
            ))
        }
    };
    if names.is_empty() {
        return Err(ServiceError::invalid(
            "`packages` is empty: name at least one package to install",
        ));
    }
    if names.len() > MAX_PACKAGES_PER_INSTALL {
        return Err(ServiceError::invalid(format!(
            "{} packages were named, more than the {MAX_PACKAGES_PER_INSTALL} one install may \
             take; install them in several requests",
            names.len()
        )));
    }
    Ok(names)
}

impl Service {
    fn installer(&self) -> Option<&Arc<Installer>> {
        self.inner.cfg.packages.as_ref()
    }

    /// The libraries a call of `tenant` has after R's own: the tenant's
    /// library (made if it is not there yet, so that a package installed
    /// during a session is seen by it), or none when installing is off.
    pub(super) fn tenant_libraries(&self, tenant: &str) -> Result<Vec<PathBuf>, ServiceError> {
        let Some(inst) = self.installer() else {
            return Ok(Vec::new());
        };
        self.sync_library(inst, tenant);
        let lib = inst.library(tenant);
        std::fs::create_dir_all(&lib).map_err(|e| {
            ServiceError::new(
                ErrorCode::Storage,
                format!(
                    "cannot make the tenant's package library {} ({e}); check the packages \
                     directory of the server",
                    lib.display()
                ),
            )
        })?;
        Ok(vec![lib])
    }

    /// The `rvisor.install` host tool of `tenant`'s calls, when installing
    /// is on: R's `install.packages()` comes to it.
    pub(super) fn install_tool(&self, tenant: &str) -> Option<rvisor::Tool> {
        let inst = self.installer()?.clone();
        let service = Arc::downgrade(&self.inner);
        let tenant = tenant.to_string();
        let tool = rvisor::Tool::new(
            INSTALL_TOOL,
            "Install packages (and their dependencies) from the server's repositories into the tenant's library",
            json!({"type": "object", "properties": {"packages": {"type": "array", "items": {"type": "string"}}}}),
            move |call| {
                let names = package_names(&call.args["packages"]).map_err(|e| e.message)?;
                let installed = inst
                    .install(&tenant, &names)
                    .map_err(|e| package_error(&e).message)?;
                if let Some(inner) = service.upgrade() {
                    Service { inner }.share_installed(&inst, &tenant, &installed);
                }
                Ok(json!({"installed": installed}))
            },
        );
        // The name is a constant that matches the rules.
        Some(tool.unwrap_or_else(|e| unreachable!("{e}")))
    }

    /// Installs what `request` asks for: its `packages` (names, with their
    /// dependencies) or its `lockfile` (exactly those versions), one of
    /// the two. A server that installs nothing answers 404 first, whatever
    /// the body.
    pub fn install_request(
        &self,
        tenant: &str,
        request: &Value,
    ) -> Result<Vec<Installed>, ServiceError> {
        let inst = self.installer_or_404()?;
        match (request.get("packages"), request.get("lockfile")) {
            (Some(p), None) => {
                let names = package_names(p)?;
                self.install_packages(tenant, &names)
            }
            (None, Some(l)) => {
                let lock: rvisor_packages::Lockfile =
                    serde_json::from_value(l.clone()).map_err(|e| {
                        ServiceError::invalid(format!(
                            "`lockfile` is not a lockfile ({e}); use what GET \
                             /v1/packages/lockfile answers"
                        ))
                    })?;
                let done = inst
                    .install_lockfile(tenant, &lock)
                    .map_err(|e| package_error(&e))?;
                self.share_installed(inst, tenant, &done);
                Ok(done)
            }
            _ => Err(ServiceError::invalid(
                "give either `packages` (names) or `lockfile` (from GET /v1/packages/lockfile)",
            )),
        }
    }

    /// The tenant's library as a lockfile (`GET /v1/packages/lockfile`).
    pub fn package_lockfile(
        &self,
        tenant: &str,
    ) -> Result<rvisor_packages::Lockfile, ServiceError> {
        let inst = self.installer_or_404()?;
        self.sync_library(inst, tenant);
        Ok(inst.lockfile(tenant))
    }

    fn installer_or_404(&self) -> Result<&Arc<Installer>, ServiceError> {
        // As an operation the server does not offer (checkpoints without
        // a store): 404.
        self.installer().ok_or_else(|| {
            ServiceError::new(
                ErrorCode::NotFound,
                "installing packages is off on this server: an operator turns it on with \
                 `rvisor serve --package-repo URL` (docs/packages.md)",
            )
        })
    }

    /// Installs `names` and their dependencies into `tenant`'s library:
    /// what was installed (dependencies included; `cached` when the build
    /// came from the shared cache). On any error the library is as it was.
    pub fn install_packages(
        &self,
        tenant: &str,
        names: &[String],
    ) -> Result<Vec<Installed>, ServiceError> {
        let inst = self.installer_or_404()?;
        if names.is_empty() {
            return Err(ServiceError::invalid(
                "no package was named: give at least one package to install",
            ));
        }
        let done = inst.install(tenant, names).map_err(|e| package_error(&e))?;
        self.share_installed(inst, tenant, &done);
        Ok(done)
    }

    /// Puts what `tenant` just installed in the shared store, so every
    /// node of it has the library without building: each package's built
    /// tree once (by R version, platform, name, version and tarball
    /// digest), then the tenant's manifest. A failure is logged: the
    /// install stands on this node, and other nodes build for themselves.
    fn share_installed(&self, inst: &Installer, tenant: &str, done: &[Installed]) {
        if done.is_empty() {
            return;
        }
        let store = self.inner.tables.store();
        let shared = (|| -> Result<(), String> {
            for p in done {
                let Some(name) = inst.build_name(p) else {
                    continue;
                };
                let key = format!("packages/builds/{name}");
                if store.head(&key).map_err(|e| e.to_string())?.is_some() {
                    continue;
                }
                let pack = std::env::temp_dir().join(format!(
                    "rvisor-pack-{}-{}.tar.gz",
                    std::process::id(),
                    rvisor::ids::random_hex(6)
                ));
                let put = inst
                    .pack(tenant, &p.name, &pack)
                    .map_err(|e| e.to_string())
                    .and_then(|()| store.put_file(&key, &pack).map_err(|e| e.to_string()));
                let _ = std::fs::remove_file(&pack);
                put?;
            }
            merge_manifest(store, &manifest_key(tenant), &inst.installed(tenant), || {})
        })();
        if let Err(e) = shared {
            tracing::warn!(
                target: "rvisor::packages",
                "the packages installed for a tenant were not put in the shared store {} ({e}); \
                 other nodes will build them when asked",
                store.url()
            );
        }
    }

    /// Takes into this node's copy of `tenant`'s library what the shared
    /// store's manifest has and it lacks (installed on another node, or
    /// before a restart on a fresh disk), from the stored builds: at most
    /// every [`SYNC_EVERY`] per tenant. A failure is logged; the calls go
    /// on with the library as it is.
    fn sync_library(&self, inst: &Installer, tenant: &str) {
        {
            let mut last = lock(&self.inner.package_sync);
            if last.get(tenant).is_some_and(|t| t.elapsed() < SYNC_EVERY) {
                return;
            }
            last.insert(tenant.to_string(), Instant::now());
        }
        let store = self.inner.tables.store();
        let remote: Vec<Installed> = match store.get(&manifest_key(tenant)) {
            Ok(Some(b)) => serde_json::from_slice(&b.bytes).unwrap_or_default(),
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(target: "rvisor::packages", "cannot read a tenant's package manifest from the shared store: {e}");
                return;
            }
        };
        let fetch = |p: &Installed, dst: &std::path::Path| -> Result<bool, String> {
            let Some(name) = inst.build_name(p) else {
                return Ok(false);
            };
            store
                .get_to_file(&format!("packages/builds/{name}"), dst)
                .map_err(|e| e.to_string())
        };
        if let Err(e) = inst.adopt(tenant, &remote, &fetch) {
            tracing::warn!(target: "rvisor::packages", "cannot take a tenant's packages from the shared store: {e}");
        }
    }

    /// Names the repository of each tenant package `r` reports loaded,
    /// from the tenant's manifest (the worker knows names and versions).
    pub(super) fn name_package_sources(&self, tenant: &str, r: &mut rvisor::RunResult) {
        let Some(inst) = self.installer() else {
            return;
        };
        if r.packages_loaded.is_empty() {
            return;
        }
        let manifest = inst.installed(tenant);
        for p in &mut r.packages_loaded {
            p.repository = manifest
                .iter()
                .find(|m| m.name == p.name && m.version == p.version)
                .map(|m| m.repository.clone());
        }
    }

    /// The install policy as health shows it (`package_install`): `null`
    /// when installing is off.
    pub fn package_policy(&self) -> Value {
        match self.installer() {
            None => Value::Null,
            Some(inst) => {
                let mut v = serde_json::to_value(inst.policy()).unwrap_or_default();
                let sandbox = inst.builder_sandbox();
                v["builds_without_network"] = json!(sandbox.network);
                v["builder"] = json!(sandbox);
                v
            }
        }
    }

    /// What `tenant` can load (the site's packages and its own library's)
    /// and what it may install: `GET /v1/packages`.
    pub fn packages_report(&self, tenant: &str) -> Result<Value, ServiceError> {
        let site = self.packages()?;
        let (tenant_pkgs, install) = match self.installer() {
            None => (Vec::new(), Value::Null),
            Some(inst) => {
                self.sync_library(inst, tenant);
                (inst.installed(tenant), self.package_policy())
            }
        };
        Ok(json!({
            "packages": site,
            "tenant_packages": tenant_pkgs,
            "install": install,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pkg(name: &str) -> Installed {
        Installed {
            name: name.into(),
            version: "1.0".into(),
            repository: "file:///repo".into(),
            cached: false,
            requested: true,
            sha256: None,
        }
    }

    fn names_in(store: &crate::blob::BlobStore, key: &str) -> Vec<String> {
        let b = store.get(key).unwrap().expect("a manifest");
        let m: Vec<Installed> = serde_json::from_slice(&b.bytes).unwrap();
        m.into_iter().map(|i| i.name).collect()
    }

    #[test]
    fn two_nodes_installing_for_one_tenant_at_once_both_keep_their_packages() {
        let dir = std::env::temp_dir().join(format!(
            "rvisor-manifest-{}-{}",
            std::process::id(),
            rvisor::ids::random_hex(4)
        ));
        let url: crate::blob::StoreUrl = format!("file://{}", dir.display()).parse().unwrap();
        let store = crate::blob::BlobStore::open(&url).unwrap();
        let key = manifest_key("t");
        // The first write of a manifest, with another node's first write
        // landing between this node's read and write.
        let mut raced = false;
        merge_manifest(&store, &key, &[pkg("mine")], || {
            if !std::mem::replace(&mut raced, true) {
                merge_manifest(&store, &key, &[pkg("theirs")], || {}).unwrap();
            }
        })
        .unwrap();
        assert_eq!(names_in(&store, &key), ["mine", "theirs"]);
        // And a replacement, raced the same way.
        let mut raced = false;
        merge_manifest(&store, &key, &[pkg("mine"), pkg("later")], || {
            if !std::mem::replace(&mut raced, true) {
                merge_manifest(&store, &key, &[pkg("theirs"), pkg("other")], || {}).unwrap();
            }
        })
        .unwrap();
        assert_eq!(names_in(&store, &key), ["later", "mine", "other", "theirs"]);
        // A store that changes under every try: an error, not a lost write.
        let e = merge_manifest(&store, &key, &[pkg("x")], || {
            store.put(&key, b"[]".to_vec()).unwrap();
        })
        .unwrap_err();
        assert!(e.contains("changed under every"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn names_from_a_string_or_a_list() {
        assert_eq!(package_names(&json!("janitor")).unwrap(), vec!["janitor"]);
        assert_eq!(
            package_names(&json!(["a1", "b2"])).unwrap(),
            vec!["a1", "b2"]
        );
        for bad in [json!([]), json!(3), json!([1]), json!(null)] {
            let e = package_names(&bad).unwrap_err();
            assert_eq!(e.code, ErrorCode::Invalid, "{bad}");
        }
        let many: Vec<String> = (0..=MAX_PACKAGES_PER_INSTALL)
            .map(|i| format!("p{i}"))
            .collect();
        assert!(package_names(&json!(many))
            .unwrap_err()
            .message
            .contains("several requests"));
    }

    #[test]
    fn a_package_error_names_its_step_and_rule() {
        let e = package_error(&PackageError::Refused {
            package: "evil".into(),
            rule: "deny",
            detail: "the operator denies it".into(),
        });
        assert_eq!(e.code, ErrorCode::Package);
        let j = e.to_json();
        assert_eq!(j["code"], "package");
        assert_eq!(j["details"]["reason"], "refused");
        assert_eq!(j["details"]["rule"], "deny");
        assert_eq!(j["details"]["package"], "evil");
        assert!(j["message"].as_str().unwrap().contains("'deny'"));
        let long = "é".repeat(10_000);
        let b = package_error(&PackageError::Build {
            package: "p".into(),
            detail: "failed".into(),
            log: long.clone(),
        });
        let tail = b.details.unwrap()["log"].as_str().unwrap().to_string();
        assert!(tail.len() <= 8 << 10 && long.ends_with(&tail));
    }
}
