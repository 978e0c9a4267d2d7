//! `rvisor kernel install`: writes a kernelspec (`kernel.json` and a
//! logo) where Jupyter looks for kernels, so every front end can start
//! this kernel.

use crate::error::KernelError;
use serde_json::json;
use std::path::{Path, PathBuf};

/// Where to install.
#[derive(Debug, Clone)]
pub enum Target {
    /// The user's Jupyter data directory (`$JUPYTER_DATA_DIR`, else
    /// `~/.local/share/jupyter`).
    User,
    /// `PREFIX/share/jupyter` (a virtualenv's or conda's prefix).
    Prefix(PathBuf),
    /// The system-wide `/usr/local/share/jupyter`.
    System,
}

/// The kernels directory of `target`.
pub fn kernels_dir(target: &Target) -> Result<PathBuf, String> {
    Ok(match target {
        Target::User => match std::env::var_os("JUPYTER_DATA_DIR") {
            Some(d) => PathBuf::from(d),
            None => {
                let home = std::env::var_os("HOME")
                    .ok_or("HOME is not set; pass --prefix DIR instead of --user")?;
                PathBuf::from(home).join(".local/share/jupyter")
            }
        },
        Target::Prefix(p) => p.join("share/jupyter"),
        Target::System => PathBuf::from("/usr/local/share/jupyter"),
    }
    .join("kernels"))
}

/// The `kernel.json` of a kernel started as `program kernel
/// --connection-file FILE extra...`.
pub fn spec(program: &Path, display_name: &str, extra: &[String]) -> serde_json::Value {
    let mut argv = vec![
        program.display().to_string(),
        "kernel".to_string(),
        "--connection-file".to_string(),
        "{connection_file}".to_string(),
    ];
    argv.extend(extra.iter().cloned());
    json!({
        "argv": argv,
        "display_name": display_name,
        "language": "R",
        // Interrupts come as control messages, which gateways and remote
        // front ends can send; the kernel also takes SIGINT.
        "interrupt_mode": "message",
        "metadata": {"debugger": false},
    })
}

/// The 32x32 logo: a PNG made once by `scripts/kernel-logo.R`, kept small.
const LOGO_32: &[u8] = include_bytes!("logo-32x32.png");

/// Writes the kernelspec `name` into `target`; gives its directory.
pub fn install(
    target: &Target,
    name: &str,
    display_name: &str,
    program: &Path,
    extra: &[String],
) -> Result<PathBuf, KernelError> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.');
    let fail = |dir: &Path, why: String| KernelError::Install {
        dir: dir.display().to_string(),
        why,
    };
    if !valid {
        return Err(fail(
            Path::new(name),
            "a kernel name is 1 to 64 letters, digits, '-', '_' or '.' (not first)".into(),
        ));
    }
    let dir = kernels_dir(target)
        .map_err(|why| fail(Path::new("?"), why))?
        .join(name);
    std::fs::create_dir_all(&dir).map_err(|e| fail(&dir, e.to_string()))?;
    let text = serde_json::to_string_pretty(&spec(program, display_name, extra))
        .map_err(|e| fail(&dir, e.to_string()))?;
    std::fs::write(dir.join("kernel.json"), text + "\n").map_err(|e| fail(&dir, e.to_string()))?;
    std::fs::write(dir.join("logo-32x32.png"), LOGO_32).map_err(|e| fail(&dir, e.to_string()))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_spec_jupyter_can_read() {
        let tmp = std::env::temp_dir().join(format!("rvisor-spec-{}", std::process::id()));
        let dir = install(
            &Target::Prefix(tmp.clone()),
            "rvisor",
            "R (rvisor)",
            Path::new("/usr/bin/rvisor"),
            &["--timeout".into(), "60".into()],
        )
        .unwrap();
        assert_eq!(dir, tmp.join("share/jupyter/kernels/rvisor"));
        let spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("kernel.json")).unwrap()).unwrap();
        assert_eq!(spec["argv"][3], "{connection_file}");
        assert_eq!(spec["argv"][5], "60");
        assert_eq!(spec["language"], "R");
        assert!(install(
            &Target::Prefix(tmp.clone()),
            "../x",
            "x",
            Path::new("/x"),
            &[]
        )
        .is_err());
        let _ = std::fs::remove_dir_all(tmp);
    }
}
