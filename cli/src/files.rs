//! `rvisor run --input FILE... --output-dir DIR`: input files placed in
//! the run's private working directory before the script runs, and the
//! files it wrote (new or changed; `tempdir()` left out) copied to DIR and
//! listed as the result's `artifacts` (docs/files.md).

use rvisor::file_rules::FileLimits;
use rvisor::files::{changed_files, RunFiles, Snapshot, WorkDir};
use rvisor::{Artifact, RunResult};
use std::io::{Read, Write};
use std::path::PathBuf;

/// The files of one `rvisor run`.
pub struct CliFiles {
    /// Host files to put in, each under its file name.
    pub inputs: Vec<PathBuf>,
    /// Where the files the script wrote go.
    pub output_dir: Option<PathBuf>,
    /// The quotas (the library's defaults).
    pub limits: FileLimits,
    before: Snapshot,
}

impl CliFiles {
    /// Files for `inputs` and `output_dir`.
    pub fn new(inputs: Vec<PathBuf>, output_dir: Option<PathBuf>) -> Self {
        Self {
            inputs,
            output_dir,
            limits: FileLimits::default(),
            before: Snapshot::new(),
        }
    }
}

impl RunFiles for CliFiles {
    fn before(&mut self, dir: &WorkDir) -> Result<(), String> {
        for p in &self.inputs {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .ok_or_else(|| format!("--input {}: not a file name", p.display()))?;
            let mut f =
                std::fs::File::open(p).map_err(|e| format!("--input {}: {e}", p.display()))?;
            dir.put(&name, &mut f, &self.limits)
                .map_err(|e| format!("--input {}: {e}", p.display()))?;
        }
        self.before = dir
            .snapshot(self.limits.max_files)
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    fn after(&mut self, dir: &WorkDir, r: &mut RunResult) {
        let Some(out) = &self.output_dir else {
            return;
        };
        // Nothing ran: nothing it wrote (the inputs are not its files).
        if matches!(
            r.outcome,
            rvisor::Outcome::Rejected
                | rvisor::Outcome::StartupFailed
                | rvisor::Outcome::StartupTimedOut
        ) {
            return;
        }
        let after = match dir.snapshot(self.limits.max_files) {
            Ok(a) => a,
            Err(e) => {
                r.warnings
                    .push(format!("rvisor: the run's files were not collected: {e}"));
                return;
            }
        };
        for f in changed_files(&self.before, &after) {
            match copy_out(dir, &f.name, out) {
                Ok(a) => r.artifacts.push(a),
                Err(e) => r
                    .warnings
                    .push(format!("rvisor: {:?} was not saved: {e}", f.name)),
            }
        }
    }
}

/// Copies `name` (a checked relative name from a listing) to `out/name`,
/// hashing it on the way.
fn copy_out(dir: &WorkDir, name: &str, out: &std::path::Path) -> Result<Artifact, String> {
    use sha2::Digest;
    let (info, f) = dir.open(name).map_err(|e| e.to_string())?;
    let dst = out.join(&info.name);
    if let Some(parent) = dst.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    let mut w = std::fs::File::create(&dst).map_err(|e| format!("{}: {e}", dst.display()))?;
    let mut h = sha2::Sha256::new();
    let mut r = f.take(info.size);
    let mut buf = vec![0u8; 256 << 10];
    loop {
        let n = r.read(&mut buf).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        w.write_all(&buf[..n])
            .map_err(|e| format!("{}: {e}", dst.display()))?;
    }
    Ok(Artifact {
        uri: format!(
            "file://{}",
            std::path::absolute(&dst).unwrap_or(dst).display()
        ),
        name: info.name,
        size: info.size,
        media_type: info.media_type,
        sha256: h.finalize().iter().map(|b| format!("{b:02x}")).collect(),
    })
}
