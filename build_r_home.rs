// Where R is, for the build scripts (`include!`d by build.rs and
// supervisor/build.rs): the `R_HOME` environment variable, else what
// `R RHOME` prints. Panics with what to install when neither works.
fn r_home() -> std::path::PathBuf {
    match std::env::var("R_HOME") {
        Ok(home) if !home.is_empty() => std::path::PathBuf::from(home),
        _ => {
            let out = std::process::Command::new("R")
                .args(["RHOME"])
                .output()
                .unwrap_or_else(|e| {
                    panic!(
                        "failed to run `R RHOME` ({e}): install R (Debian: apt-get install \
                         r-base-core r-base-dev) or set R_HOME"
                    )
                });
            assert!(
                out.status.success(),
                "`R RHOME` failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        }
    }
}
