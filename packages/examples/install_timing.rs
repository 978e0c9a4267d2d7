//! Measures an install: the first one of a package into tenant `a` (a
//! build) and the same package into tenant `b` (from the cache), each
//! timed once, with the state directory emptied first.
//!
//! `cargo run --release -p rvisor-packages --example install_timing --
//! file:///path/to/repo PACKAGE STATE_DIR` (docs/packages.md).

use std::path::PathBuf;
use std::time::Instant;

use rvisor_packages::{Installer, Policy, RInfo, Repository};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(repo), Some(pkg), Some(state)) = (args.next(), args.next(), args.next()) else {
        return Err("usage: install_timing REPO_URL PACKAGE STATE_DIR".into());
    };
    let state = PathBuf::from(state);
    let _ = std::fs::remove_dir_all(&state);
    let policy = Policy {
        repositories: vec![Repository::parse(&repo)?],
        ..Policy::default()
    };
    let inst = Installer::new(policy, state, RInfo::probe("R".as_ref(), &[])?);
    for tenant in ["a", "b"] {
        let t = Instant::now();
        let got = inst.install(tenant, std::slice::from_ref(&pkg))?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        let cached = got.iter().all(|i| i.cached);
        println!(
            "tenant {tenant}: {ms:.1} ms, {} package(s), cached: {cached}",
            got.len()
        );
    }
    Ok(())
}
