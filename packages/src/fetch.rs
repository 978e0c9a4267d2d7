//! Downloads on the host (workers and builders never get network):
//! `file://` read directly, `http(s)://` with a blocking client; both stop
//! at a byte cap. Checksums of what was fetched.

use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use md5::Md5;
use sha2::{Digest, Sha256};

use crate::PackageError;

/// The bytes at `url`, at most `cap` of them (past it: an error).
pub fn fetch_bytes(url: &str, cap: u64) -> Result<Vec<u8>, PackageError> {
    let mut out = Vec::new();
    copy_capped(open(url)?, &mut out, cap, url)?;
    Ok(out)
}

/// Writes what is at `url` to `dest` (created), at most `cap` bytes.
pub fn fetch_to(url: &str, dest: &Path, cap: u64) -> Result<u64, PackageError> {
    let mut f = std::fs::File::create(dest)
        .map_err(PackageError::io(format!("create {}", dest.display())))?;
    let n = copy_capped(open(url)?, &mut f, cap, url)?;
    f.flush()
        .map_err(PackageError::io(format!("write {}", dest.display())))?;
    Ok(n)
}

fn open(url: &str) -> Result<Box<dyn Read + Send>, PackageError> {
    let err = |detail: String| PackageError::Download {
        url: url.into(),
        detail,
    };
    if let Some(path) = url.strip_prefix("file://") {
        let f = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
        return Ok(Box::new(f));
    }
    let agent = ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(10))
        .timeout_read(Duration::from_secs(60))
        .redirects(3)
        .build();
    match agent.get(url).call() {
        Ok(r) => Ok(Box::new(r.into_reader())),
        Err(ureq::Error::Status(code, _)) => Err(err(format!("the server answered {code}"))),
        Err(e) => Err(err(e.to_string())),
    }
}

fn copy_capped(
    mut r: Box<dyn Read + Send>,
    w: &mut dyn Write,
    cap: u64,
    url: &str,
) -> Result<u64, PackageError> {
    let mut buf = vec![0u8; 64 << 10];
    let mut n: u64 = 0;
    loop {
        let k = r.read(&mut buf).map_err(|e| PackageError::Download {
            url: url.into(),
            detail: e.to_string(),
        })?;
        if k == 0 {
            return Ok(n);
        }
        n += k as u64;
        if n > cap {
            return Err(PackageError::Refused {
                package: url.rsplit('/').next().unwrap_or(url).into(),
                rule: "download_bytes",
                detail: format!("the download is larger than the cap of {cap} bytes"),
            });
        }
        w.write_all(&buf[..k])
            .map_err(PackageError::io("write a download"))?;
    }
}

/// The MD5 and SHA-256 of a file, lower-case hex.
pub fn digests(path: &Path) -> Result<(String, String), PackageError> {
    let mut f =
        std::fs::File::open(path).map_err(PackageError::io(format!("open {}", path.display())))?;
    let (mut m, mut s) = (Md5::new(), Sha256::new());
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let k = f
            .read(&mut buf)
            .map_err(PackageError::io(format!("read {}", path.display())))?;
        if k == 0 {
            break;
        }
        m.update(&buf[..k]);
        s.update(&buf[..k]);
    }
    Ok((hex(&m.finalize()), hex(&s.finalize())))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_the_known_ones_and_the_cap_holds() {
        let d = std::env::temp_dir().join(format!("rvisor-fetch-{}", std::process::id()));
        std::fs::write(&d, b"abc").unwrap();
        let (m, s) = digests(&d).unwrap();
        assert_eq!(m, "900150983cd24fb0d6963f7d28e17f72");
        assert_eq!(
            s,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let url = format!("file://{}", d.display());
        assert_eq!(fetch_bytes(&url, 3).unwrap(), b"abc");
        assert!(matches!(
            fetch_bytes(&url, 2),
            Err(PackageError::Refused {
                rule: "download_bytes",
                ..
            })
        ));
        std::fs::remove_file(&d).unwrap();
    }
}
