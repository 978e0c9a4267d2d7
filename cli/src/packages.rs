//! The flags of packages on demand (`rvisor serve --package-repo ...`,
//! docs/packages.md) and the installer they make.

use crate::out;
use anyhow::{Context, Result};
use rvisor_packages::{Installer, Policy, RInfo, Repository};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Packages on demand: tenants install packages from these repositories
/// into libraries of their own (off without `--package-repo`).
#[derive(Debug, clap::Args)]
pub struct PackageArgs {
    /// A CRAN-like repository tenants may install from: `https://...`,
    /// `http://...` or `file:///dir` (repeatable; searched in order). With
    /// it, `install.packages()` in R and POST /v1/packages/install install
    /// into the tenant's library.
    #[arg(long = "package-repo", value_name = "URL", value_parser = repository)]
    pub repos: Vec<Repository>,
    /// Only these packages may be installed, dependencies included
    /// (repeatable, or comma-separated). Default: any in the repositories.
    #[arg(
        long = "package-allow",
        value_name = "NAME",
        value_delimiter = ',',
        requires = "repos"
    )]
    pub allow: Vec<String>,
    /// Never these packages, even as a dependency (repeatable, or
    /// comma-separated).
    #[arg(
        long = "package-deny",
        value_name = "NAME",
        value_delimiter = ',',
        requires = "repos"
    )]
    pub deny: Vec<String>,
    /// Refuse packages that compile code (`NeedsCompilation: yes`).
    #[arg(long = "package-no-compiled", requires = "repos")]
    pub no_compiled: bool,
    /// The most one downloaded package may be, MiB.
    #[arg(long = "package-max-download-mb", value_name = "MIB", default_value_t = rvisor_packages::policy::DEFAULT_MAX_DOWNLOAD_BYTES >> 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_download_mb: u64,
    /// The most one tenant's library may hold, MiB.
    #[arg(long = "package-library-mb", value_name = "MIB", default_value_t = rvisor_packages::policy::DEFAULT_MAX_LIBRARY_BYTES >> 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub library_mb: u64,
    /// The longest one package's build may take, seconds.
    #[arg(long = "package-build-timeout-secs", value_name = "SECS", default_value_t = rvisor_packages::policy::DEFAULT_BUILD_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    pub build_timeout_secs: u64,
    /// Where tenant libraries and the build cache are kept. Default:
    /// STATE_DIR/packages with --state-dir, else DATA_DIR/packages with
    /// --data-dir, else a directory under the system's temporary one.
    #[arg(long = "package-dir", value_name = "DIR", requires = "repos")]
    pub dir: Option<PathBuf>,
}

fn repository(s: &str) -> Result<Repository, String> {
    Repository::parse(s)
}

impl PackageArgs {
    /// The installer of these flags (`None` without a repository): the
    /// policy checked, R asked for its version and site packages.
    pub fn installer(
        &self,
        state_dir: Option<&Path>,
        data_dir: Option<&Path>,
        libpath: &[PathBuf],
    ) -> Result<Option<Arc<Installer>>> {
        if self.repos.is_empty() {
            return Ok(None);
        }
        for name in self.allow.iter().chain(&self.deny) {
            if !rvisor_packages::policy::valid_name(name) {
                anyhow::bail!(
                    "--package-allow/--package-deny: {name:?} is not an R package name \
                     (letters, digits and '.', starting with a letter)"
                );
            }
        }
        let policy = Policy {
            repositories: self.repos.clone(),
            allow: (!self.allow.is_empty()).then(|| self.allow.iter().cloned().collect()),
            deny: self.deny.iter().cloned().collect(),
            compiled: !self.no_compiled,
            max_download_bytes: self.max_download_mb << 20,
            max_library_bytes: self.library_mb << 20,
            build_timeout: Duration::from_secs(self.build_timeout_secs),
            ..Policy::default()
        };
        let dir = match (&self.dir, state_dir, data_dir) {
            (Some(d), _, _) => d.clone(),
            (None, Some(s), _) => s.join("packages"),
            (None, None, Some(d)) => d.join("packages"),
            (None, None, None) => std::env::temp_dir().join("rvisor-packages"),
        };
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("--package-dir {}: cannot create it", dir.display()))?;
        let r = r_program();
        let info = RInfo::probe(&r, libpath)
            .map_err(|e| anyhow::anyhow!("packages on demand need R to build them: {e}"))?;
        Ok(Some(Arc::new(Installer::new(policy, dir, info))))
    }
}

/// The `R` program: `$R_HOME/bin/R` when R_HOME is set, else `R` on PATH.
fn r_program() -> PathBuf {
    match std::env::var_os("R_HOME") {
        Some(h) if Path::new(&h).join("bin/R").is_file() => Path::new(&h).join("bin/R"),
        _ => PathBuf::from("R"),
    }
}

/// `rvisor packages install`: the same install as the server's, for the
/// local user, into a library `rvisor run/session --library-after` takes.
#[derive(Debug, clap::Subcommand)]
pub enum PackagesCmd {
    /// Install packages and their dependencies from --package-repo into
    /// the local tenant's library under --package-dir; prints what was
    /// installed and the library's path.
    Install {
        /// Package names.
        #[arg(required = true)]
        names: Vec<String>,
        /// Print JSON (`installed`, `library`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        packages: PackageArgs,
    },
}

/// Runs a `packages` action.
pub fn run(cmd: PackagesCmd) -> Result<std::process::ExitCode> {
    let PackagesCmd::Install {
        names,
        json,
        packages,
    } = cmd;
    let Some(inst) = packages.installer(None, None, &[])? else {
        anyhow::bail!(
            "name a repository to install from: --package-repo URL (https://..., file:///...)"
        );
    };
    let tenant = rvisor_server::service::LOCAL_TENANT;
    let names = rvisor_server::service::packages::package_names(&serde_json::json!(names))
        .map_err(|e| anyhow::anyhow!(e.message))?;
    let installed = inst.install(tenant, &names).map_err(|e| {
        anyhow::anyhow!(rvisor_server::service::packages::package_error(&e).message)
    })?;
    let lib = inst.library(tenant);
    if json {
        out::line(serde_json::to_string_pretty(
            &serde_json::json!({"installed": installed, "library": lib}),
        )?)?;
    } else {
        if installed.is_empty() {
            out::line("nothing to do: already installed at the repositories' version")?;
        }
        for p in &installed {
            out::line(format_args!(
                "installed {} {} from {}{}",
                p.name,
                p.version,
                p.repository,
                if p.cached { " (from the cache)" } else { "" }
            ))?;
        }
        out::line(format_args!(
            "library: {} (rvisor run --library-after {})",
            lib.display(),
            lib.display()
        ))?;
    }
    Ok(std::process::ExitCode::SUCCESS)
}
