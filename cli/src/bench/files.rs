//! The files rows of `rvisor bench` (`--only files`): a 100 MB file
//! uploaded to a session and downloaded back over HTTP through an
//! `rvisor serve` it starts (MB/s each way, and the growth of the
//! server's peak RSS, VmHWM), and the time artifact listing adds to a
//! one-shot run that writes 100 small files (the same run writing them
//! into `tempdir()`, which is not collected, is the baseline).

use serde::Serialize;
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Bytes of the large file.
const BIG: u64 = 100_000_000;

/// What the rows measured (medians).
#[derive(Debug, Clone, Serialize)]
pub struct FilesReport {
    /// Upload, MB/s (10^6 bytes per second), each repetition.
    pub upload_mb_s: Vec<f64>,
    /// Download, MB/s, each repetition.
    pub download_mb_s: Vec<f64>,
    /// The server's peak RSS (VmHWM) growth over all transfers, MB.
    pub server_peak_rss_growth_mb: f64,
    /// A one-shot run writing 100 files into its working directory, ms.
    pub with_artifacts_ms: Vec<f64>,
    /// The same run writing them into tempdir() (no artifacts), ms.
    pub without_artifacts_ms: Vec<f64>,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn hwm_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// A reader of `left` bytes of a repeating 64 KiB block (never held
/// whole).
struct Pattern {
    left: u64,
    block: Vec<u8>,
}

impl Pattern {
    fn new(left: u64) -> Self {
        Self {
            left,
            block: (0..64 << 10).map(|i| (i % 251) as u8).collect(),
        }
    }
}

impl Read for Pattern {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.block.len()).min(self.left as usize);
        buf[..n].copy_from_slice(&self.block[..n]);
        self.left -= n as u64;
        Ok(n)
    }
}

/// Runs the rows with `reps` transfers each way and `runs` runs each.
pub fn run(
    reps: usize,
    runs: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<FilesReport, String> {
    let dir =
        std::env::temp_dir().join(format!("rvisor-bench-files-{}", rvisor::ids::random_hex(6)));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let child = Command::new(exe)
        .args([
            "serve",
            "--no-auth",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start rvisor serve: {e}"))?;
    let server = Server(child);
    let pid = server.0.id();
    let base = format!("http://127.0.0.1:{port}");
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(600))
        .build();
    let deadline = Instant::now() + Duration::from_secs(60);
    while agent.get(&format!("{base}/readyz")).call().is_err() {
        if Instant::now() > deadline {
            return Err("rvisor serve did not become ready in 60 s".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let json = |r: Result<ureq::Response, ureq::Error>| -> Result<serde_json::Value, String> {
        let r = r.map_err(|e| e.to_string())?;
        let mut s = String::new();
        r.into_reader()
            .read_to_string(&mut s)
            .map_err(|e| e.to_string())?;
        serde_json::from_str(&s).map_err(|e| e.to_string())
    };
    let created = json(
        agent
            .post(&format!("{base}/v1/sessions"))
            .set("Content-Type", "application/json")
            .send_string("{}"),
    )?;
    let id = created["id"].as_str().ok_or("no session id")?.to_string();
    let url = format!("{base}/v1/sessions/{id}/files/big.bin");
    let before = hwm_kb(pid).unwrap_or(0);
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for i in 0..reps {
        progress(&format!("files: 100 MB up and down, {}/{reps}", i + 1));
        let t = Instant::now();
        agent
            .put(&url)
            .set("Content-Length", &BIG.to_string())
            .send(Pattern::new(BIG))
            .map_err(|e| format!("upload: {e}"))?;
        up.push(BIG as f64 / 1e6 / t.elapsed().as_secs_f64());
        let t = Instant::now();
        let r = agent
            .get(&url)
            .call()
            .map_err(|e| format!("download: {e}"))?;
        let n = std::io::copy(&mut r.into_reader(), &mut std::io::sink())
            .map_err(|e| format!("download: {e}"))?;
        if n != BIG {
            return Err(format!("downloaded {n} bytes of {BIG}"));
        }
        down.push(BIG as f64 / 1e6 / t.elapsed().as_secs_f64());
    }
    let after = hwm_kb(pid).unwrap_or(0);
    let write = |into: &str| {
        format!(
            "for (i in 1:100) writeLines(as.character(i), file.path({into}, sprintf('f%03d.txt', i)))"
        )
    };
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for i in 0..runs {
        progress(&format!("files: 100 small files, run {}/{runs}", i + 1));
        for (script, out, want) in [
            (write("'.'"), &mut with, 100),
            (write("tempdir()"), &mut without, 0),
        ] {
            let body = serde_json::json!({ "script": script }).to_string();
            let t = Instant::now();
            let r = json(
                agent
                    .post(&format!("{base}/v1/run"))
                    .set("Content-Type", "application/json")
                    .send_string(&body),
            )?;
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            let got = r["artifacts"].as_array().map_or(0, Vec::len);
            if got != want {
                return Err(format!("a run listed {got} artifacts, not {want}: {r}"));
            }
            out.push(ms);
        }
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(FilesReport {
        upload_mb_s: up,
        download_mb_s: down,
        server_peak_rss_growth_mb: after.saturating_sub(before) as f64 / 1024.0,
        with_artifacts_ms: with,
        without_artifacts_ms: without,
    })
}

/// The rows as Markdown.
pub fn table(r: &FilesReport) -> String {
    let (w, wo) = (
        median(&r.with_artifacts_ms),
        median(&r.without_artifacts_ms),
    );
    format!(
        "\n## Files (HTTP, one `rvisor serve`)\n\n| row | median |\n| --- | ---: |\n\
         | upload 100 MB (PUT, streamed) | {:.0} MB/s |\n\
         | download 100 MB (GET, streamed) | {:.0} MB/s |\n\
         | server peak RSS growth over {} round trips | {:.1} MB |\n\
         | one-shot run writing 100 files, collected as artifacts | {w:.1} ms |\n\
         | the same run writing them into tempdir() (not collected) | {wo:.1} ms |\n\
         | artifact listing and storing adds | {:.1} ms |\n",
        median(&r.upload_mb_s),
        median(&r.download_mb_s),
        r.upload_mb_s.len(),
        r.server_peak_rss_growth_mb,
        w - wo
    )
}
