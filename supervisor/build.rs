//! Bakes in the build-time R_HOME (`RVISOR_BUILD_R_HOME`), the default the
//! worker starts R with when `R_HOME` is unset, so the supervisor can read
//! the installation's version without starting R (`installed_r_version`).

include!("../build_r_home.rs");

fn main() {
    println!("cargo:rerun-if-env-changed=R_HOME");
    println!("cargo:rustc-env=RVISOR_BUILD_R_HOME={}", r_home().display());
}
