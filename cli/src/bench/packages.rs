//! The packages rows of `rvisor bench` (`--only packages`; issue 28's
//! targets), on a CRAN-like repository built here (`R CMD build`,
//! `tools::write_PACKAGES`, served as `file://`): a pure-R package of 50
//! functions, installed
//! - first into a fresh tenant (download, checksum, listing, build),
//!   beside `R CMD INSTALL` of the same tarball into an empty library,
//!   interleaved round by round;
//! - then into another tenant, from the shared build cache;
//! - and `library()` of it in a new session, from the tenant library
//!   (after R's own) beside the same package in a library on R's own path.

use super::{ms, summarise, Stats};
use rvisor::{SessionOptions, Supervisor, SupervisorConfig};
use rvisor_packages::{Installer, Policy, RInfo, Repository};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const PKG: &str = "rvbenchpkg";

fn r(dir: &Path, args: &[&str]) -> Result<(), String> {
    let out = Command::new("R")
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|e| format!("cannot run R: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "R {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// The repository under `root`: its URL and the tarball.
fn repository(root: &Path) -> Result<(String, PathBuf), String> {
    let src = root.join("src").join(PKG);
    std::fs::create_dir_all(src.join("R")).map_err(|e| e.to_string())?;
    let desc = format!(
        "Package: {PKG}\nVersion: 1.0\nTitle: Bench\nDescription: A package of rvisor's bench.\nAuthor: rvisor\nMaintainer: rvisor <rvisor@example.org>\nLicense: MIT\n"
    );
    let fns: String = (0..50)
        .map(|i| format!("f{i} <- function(x) {{ y <- x * {i}; if (y > 10) y - 1 else y + 1 }}\n"))
        .collect();
    let write = |p: PathBuf, s: &str| std::fs::write(p, s).map_err(|e| e.to_string());
    write(src.join("DESCRIPTION"), &desc)?;
    write(src.join("NAMESPACE"), "exportPattern('^f')\n")?;
    write(src.join("R/fns.R"), &fns)?;
    let contrib = root.join("repo/src/contrib");
    std::fs::create_dir_all(&contrib).map_err(|e| e.to_string())?;
    r(
        &contrib,
        &["CMD", "build", "--no-manual", &src.display().to_string()],
    )?;
    r(
        &contrib,
        &[
            "--vanilla",
            "-s",
            "-e",
            "tools::write_PACKAGES('.', type = 'source')",
        ],
    )?;
    Ok((
        format!("file://{}", root.join("repo").display()),
        contrib.join(format!("{PKG}_1.0.tar.gz")),
    ))
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The rows.
pub fn run(quick: bool, progress: &mut dyn FnMut(&str)) -> Result<Vec<Stats>, String> {
    let rounds = if quick { 3 } else { 7 };
    let root = std::env::temp_dir().join(format!("rvisor-bench-pkgs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    progress("packages: building the repository");
    let (url, tarball) = repository(&root)?;
    let info = RInfo::probe(Path::new("R"), &[]).map_err(|e| e.to_string())?;
    let policy = Policy {
        repositories: vec![Repository::parse(&url)?],
        ..Policy::default()
    };
    let (mut first, mut by_hand, mut cached) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        progress(&format!("packages: installs, round {}/{rounds}", round + 1));
        let state = root.join(format!("state-{round}"));
        let inst = Installer::new(policy.clone(), state, info.clone());
        let t = Instant::now();
        inst.install("a", &[PKG.into()])
            .map_err(|e| e.to_string())?;
        first.push(ms(t.elapsed()));
        let t = Instant::now();
        let got = inst
            .install("b", &[PKG.into()])
            .map_err(|e| e.to_string())?;
        cached.push(ms(t.elapsed()));
        if !got.iter().all(|i| i.cached) {
            return Err("the second tenant's install did not come from the cache".into());
        }
        let lib = root.join(format!("by-hand-{round}"));
        std::fs::create_dir_all(&lib).map_err(|e| e.to_string())?;
        let t = Instant::now();
        r(
            &root,
            &[
                "CMD",
                "INSTALL",
                &format!("--library={}", lib.display()),
                &tarball.display().to_string(),
            ],
        )?;
        by_hand.push(ms(t.elapsed()));
    }
    // library() in a new session: the tenant library after R's own, and
    // the same package on R's own path (a site library).
    let tenant_lib = root.join("state-0/tenants/61/library");
    let site_lib = root.join("by-hand-0");
    let _ = Command::new("chmod")
        .args(["-R", "a+rX"])
        .arg(&root)
        .status();
    let tenant_sup = Supervisor::new(SupervisorConfig::default()).map_err(|e| e.to_string())?;
    let mut site_cfg = SupervisorConfig::default();
    site_cfg.worker.libpath.push(site_lib.clone());
    let site_sup = Supervisor::new(site_cfg).map_err(|e| e.to_string())?;
    progress("packages: starting the zygotes");
    tenant_sup.pool().wait_ready(Duration::from_secs(120));
    site_sup.pool().wait_ready(Duration::from_secs(120));
    let code = format!("library({PKG}); f3(4)");
    let (mut from_tenant, mut from_site) = (Vec::new(), Vec::new());
    for round in 0..rounds * 3 {
        progress(&format!(
            "packages: library(), round {}/{}",
            round + 1,
            rounds * 3
        ));
        for (sup, opts, out) in [
            (
                &tenant_sup,
                SessionOptions {
                    libpath_after: vec![tenant_lib.clone()],
                    ..SessionOptions::default()
                },
                &mut from_tenant,
            ),
            (
                &site_sup,
                SessionOptions {
                    libpath: vec![site_lib.clone()],
                    ..SessionOptions::default()
                },
                &mut from_site,
            ),
        ] {
            let s = sup.session_with(opts).map_err(|e| e.to_string())?;
            s.run("1").map_err(|e| e.to_string())?.wait();
            let t = Instant::now();
            let res = s.run(&code).map_err(|e| e.to_string())?.wait();
            out.push(ms(t.elapsed()));
            if !res.success {
                return Err(format!("library({PKG}) failed: {}", res.console));
            }
            s.close();
        }
    }
    tenant_sup.shutdown();
    site_sup.shutdown();
    let _ = std::fs::remove_dir_all(&root);
    let ratio = median(&first) / median(&by_hand).max(f64::MIN_POSITIVE);
    let lib_ratio = median(&from_tenant) / median(&from_site).max(f64::MIN_POSITIVE);
    Ok(vec![
        summarise(
            "package_install_first",
            "rvisor",
            first,
            Some(format!(
                "a pure-R package of 50 functions from file://, into a new tenant (index, download, checksum, listing, build); {ratio:.2}x R CMD INSTALL beside it"
            )),
        ),
        summarise(
            "package_install_first",
            "R CMD INSTALL",
            by_hand,
            Some("`R CMD INSTALL --library=L` of the same tarball into an empty library, by hand".into()),
        ),
        summarise(
            "package_install_cached",
            "rvisor",
            cached,
            Some("the same package into a second tenant: from the build cache".into()),
        ),
        summarise(
            "package_library_tenant",
            "rvisor",
            from_tenant,
            Some(format!(
                "library() + a call in a new session, from the tenant library; {lib_ratio:.2}x the site library's"
            )),
        ),
        summarise(
            "package_library_site",
            "rvisor",
            from_site,
            Some("the same from a library on R's own path".into()),
        ),
    ])
}
