//! Shared build script for every crate that links libR.
//!
//! Finds R (the `R_HOME` environment variable, else `R RHOME`), tells the
//! linker where libR lives, embeds an rpath so the binary finds libR without
//! `LD_LIBRARY_PATH`, and bakes the build-time R_HOME in as the run-time
//! default (`RVISOR_BUILD_R_HOME`): R refuses to start without R_HOME. The
//! share, include and doc directories the `R` front-end script would export
//! are baked in the same way (`RVISOR_BUILD_R_DOC_DIR`, ...).

include!("build_r_home.rs");

fn main() {
    println!("cargo:rerun-if-env-changed=R_HOME");
    let r_home = r_home();
    let lib = r_home.join("lib");
    assert!(
        lib.join("libR.so").exists(),
        "libR.so not found in {}: R must be built as a shared library (Debian's r-base-core is)",
        lib.display()
    );
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    println!("cargo:rustc-env=RVISOR_BUILD_R_HOME={}", r_home.display());
    // The worker's own R_SaveAsPng (embedded-worker/src/png_save.rs) must be
    // in its dynamic symbol table for cairo.so's calls to bind to it.
    if std::env::var("CARGO_PKG_NAME").as_deref() == Ok("rvisor-worker") {
        println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=R_SaveAsPng");
    }
    // The `R` front-end script exports where R's shared files, headers and
    // docs are (Debian: /usr/share/R/...); embedded R gets none of them, so
    // R.home("doc") and friends pointed nowhere. Bake them in too.
    let script = std::fs::read_to_string(r_home.join("bin").join("R")).unwrap_or_default();
    for var in ["R_SHARE_DIR", "R_INCLUDE_DIR", "R_DOC_DIR"] {
        let value = script
            .lines()
            .find_map(|l| l.trim().strip_prefix(&format!("{var}=")))
            .map(|v| v.trim_matches('"').to_string())
            .filter(|v| !v.contains('$'))
            .unwrap_or_default();
        println!("cargo:rustc-env=RVISOR_BUILD_{var}={value}");
    }
}
