//! Checkpoints: a session's state written into a pipe the supervisor
//! passes (as a descriptor: a confined worker cannot open host paths, and
//! its file-size limit does not apply to a pipe), and read back into a
//! fresh worker from a file the supervisor passes. The driver
//! (`checkpoint_state`, `restore_state`) gathers and applies the state as
//! one serialised R object; this module compresses it (LZ4 frames, with a
//! content checksum, so a damaged file is refused), writes the manifest,
//! and stops at the byte cap the supervisor sets.
//!
//! The file's layout is `rvisor_protocol::checkpoint`'s. A restore reads
//! the manifest from the file's tail and decompresses the state straight
//! into the R vector `restore_state` unserialises: the compressed file is
//! never held in memory.
//!
//! The checkpoint is taken inline, on the R thread, between calls: forking
//! the worker to serialise in a child would keep the session serving, but
//! the child of a worker that is pid 1 of its pid namespace and runs under
//! seccomp would have to be reaped by a worker that is busy in R, and R is
//! not fork-safe with its devices open; see docs/sessions.md.

use crate::r::sys::*;
use crate::r::{self, RThread, R};
use crate::{console, eval};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};

use rvisor_protocol::checkpoint::{read_manifest, MAGIC};

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The directory files are saved from and restored to.
fn state_dir(working_dir: Option<String>) -> String {
    working_dir
        .filter(|w| !w.is_empty())
        .or_else(eval::home_dir)
        .unwrap_or_default()
}

/// Writes the session's state into `out` (at most `max_bytes` in all,
/// else it fails), then closes it; `Ok`: the manifest (JSON text).
pub fn checkpoint(
    r: &R,
    out: File,
    working_dir: Option<String>,
    max_file_bytes: u64,
    max_bytes: u64,
) -> Result<String, String> {
    let dir = state_dir(working_dir);
    if let Some(why) = r::string_problem(&dir) {
        return Err(format!("the working directory cannot be saved: {why}"));
    }
    console::begin(1 << 20);
    let driver = r.driver;
    // Every byte goes through the cap; SIGPIPE is ignored in the worker
    // (set by the Rust runtime, kept by R), so a supervisor that stops
    // reading gives EPIPE here, not a signal.
    let cell = std::cell::RefCell::new(Capped {
        out: &out,
        written: 0,
        max: max_bytes,
        over: false,
    });
    let (dir, capped) = (&dir[..], &cell);
    let started = std::time::Instant::now();
    // SAFETY: called on the R thread (serve's loop), after R started.
    let tok = unsafe { RThread::assume() };
    let parts = r::protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; the arguments and the
        // driver's answer are protected by `scope` while they are used; the
        // compression below makes no R call, so no jump can skip the
        // encoder's destructor.
        unsafe {
            let d = scope.protect(r::mk_string(dir));
            let cap = scope.protect(Rf_ScalarReal(max_file_bytes as f64));
            let v = scope.protect(r::call_driver(driver, c"checkpoint_state", &[d, cap])?);
            if TYPEOF(v) != SEXPTYPE::VECSXP || Rf_xlength(v) < 12 {
                return Err("the driver's checkpoint has an unexpected shape".into());
            }
            let raw = VECTOR_ELT(v, 0);
            if TYPEOF(raw) != SEXPTYPE::RAWSXP {
                return Err("the driver's checkpoint is not a raw vector".into());
            }
            let n = Rf_xlength(raw) as usize;
            let bytes: &[u8] = if n == 0 {
                &[]
            } else {
                std::slice::from_raw_parts(RAW(raw), n)
            };
            let mut texts: Vec<Vec<String>> = Vec::with_capacity(11);
            for i in 1..12 {
                texts.push(r::strings(VECTOR_ELT(v, i)));
            }
            let objects_bytes = Rf_asReal(VECTOR_ELT(v, 2));
            Ok((
                compress_into(&mut capped.borrow_mut(), bytes),
                n,
                objects_bytes,
                texts,
            ))
        }
    });
    let captured = console::take();
    let (written, state_bytes, objects_bytes, t) = parts.map_err(|e| {
        let text: String = captured
            .segments
            .iter()
            .filter_map(|s| s.console_text())
            .collect();
        format!("{e} {}", text.trim()).trim().to_string()
    })?;
    let compressed = written?;
    let unsaved: Vec<serde_json::Value> = t[2]
        .iter()
        .zip(&t[3])
        .map(|(n, why)| serde_json::json!({"name": n, "reason": why}))
        .collect();
    let packages: serde_json::Map<String, serde_json::Value> = t[5]
        .iter()
        .zip(&t[6])
        .map(|(p, v)| (p.clone(), serde_json::Value::String(v.clone())))
        .collect();
    let manifest = serde_json::json!({
        "format": 1,
        "created_at": unix_now(),
        "r_version": r.version,
        "objects": t[0],
        "objects_bytes": objects_bytes,
        "state_bytes": state_bytes,
        "compressed_bytes": compressed,
        "unsaved": unsaved,
        "attached": t[4],
        "packages": packages,
        "files": t[7],
        "files_skipped": t[8],
        "options_changed": t[9],
        "env_changed": t[10],
        "checkpoint_ms": started.elapsed().as_secs_f64() * 1e3,
    })
    .to_string();
    let mut w = capped.borrow_mut();
    w.write_all(manifest.as_bytes())
        .and_then(|_| w.write_all(&(manifest.len() as u32).to_be_bytes()))
        .map_err(|e| write_error(&w, e))?;
    drop(w);
    // Closing the pipe is what tells the supervisor the file is complete.
    drop(out);
    Ok(manifest)
}

/// The checkpoint's destination, counting bytes and refusing to pass
/// `max` (the store's cap or the tenant's quota, set by the supervisor).
struct Capped<'a> {
    out: &'a File,
    written: u64,
    max: u64,
    /// A write would have passed `max`.
    over: bool,
}

impl Write for Capped<'_> {
    /// Writes what fits under the cap, then fails: the supervisor, having
    /// read exactly `max` bytes before the failure, knows it was the cap.
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let room = self.max.saturating_sub(self.written);
        if room == 0 && !buf.is_empty() {
            self.over = true;
            return Err(std::io::Error::other(format!(
                "the checkpoint would pass its cap of {} bytes",
                self.max
            )));
        }
        let fits = buf.len().min(usize::try_from(room).unwrap_or(usize::MAX));
        let n = self.out.write(&buf[..fits])?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

fn write_error(w: &Capped<'_>, e: std::io::Error) -> String {
    if w.over {
        e.to_string()
    } else {
        format!(
            "could not write the checkpoint after {} bytes: {e}",
            w.written
        )
    }
}

/// Writes the magic and `state` as one LZ4 frame into `out`; returns the
/// compressed size. The manifest follows (see
/// `rvisor_protocol::checkpoint`).
fn compress_into(out: &mut Capped<'_>, state: &[u8]) -> Result<u64, String> {
    let start = out.written;
    let written = {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, &mut *out);
        w.write_all(MAGIC).and_then(|_| {
            let mut enc = lz4_flex::frame::FrameEncoder::with_frame_info(
                lz4_flex::frame::FrameInfo::new()
                    .content_checksum(true)
                    .content_size(Some(state.len() as u64)),
                w,
            );
            enc.write_all(state)?;
            enc.finish().map_err(std::io::Error::from)?.flush()
        })
    };
    written.map_err(|e| write_error(out, e))?;
    Ok(out.written - start - MAGIC.len() as u64)
}

/// Reads a checkpoint from `input` (a file: the manifest is at its tail)
/// and loads it into this worker.
pub fn restore(r: &R, mut input: File, working_dir: Option<String>) -> Result<String, String> {
    let (layout, manifest) = read_manifest(&mut input)?;
    let m: serde_json::Value = serde_json::from_slice(&manifest)
        .map_err(|e| format!("the checkpoint's manifest is damaged ({e})"))?;
    drop(manifest);
    let version = m["r_version"].as_str().unwrap_or("");
    if version != r.version {
        return Err(format!(
            "the checkpoint was taken with R {version} and this worker runs R {}",
            r.version
        ));
    }
    let expected = m["state_bytes"].as_u64().unwrap_or(0);
    // LZ4 expands a block at most 255 times: a manifest that claims more
    // state than its frame can hold is damaged, not an allocation to try.
    if expected > layout.frame_len.saturating_mul(255).saturating_add(1 << 16)
        || expected > R_xlen_t::MAX as u64
    {
        return Err(format!(
            "the checkpoint is damaged (its manifest claims {expected} bytes of state, more \
             than its {} compressed bytes can hold)",
            layout.frame_len
        ));
    }
    input
        .seek(SeekFrom::Start(layout.frame_offset))
        .map_err(|e| format!("could not read the checkpoint ({e})"))?;
    let frame = std::io::BufReader::with_capacity(1 << 20, (&input).take(layout.frame_len));
    let frame = std::cell::RefCell::new(Some(frame));
    let dir = state_dir(working_dir);
    if let Some(why) = r::string_problem(&dir) {
        return Err(format!("the working directory cannot be restored: {why}"));
    }
    console::begin(1 << 20);
    let driver = r.driver;
    let (dir, frame) = (&dir[..], &frame);
    // SAFETY: called on the R thread (serve's loop), after R started.
    let tok = unsafe { RThread::assume() };
    let done = r::protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; the raw vector is
        // allocated with the state's length (an allocation that fails
        // jumps before any value with a destructor exists) and filled by
        // the decoder, which makes no R call, before R sees it; every
        // argument is protected by `scope`.
        unsafe {
            let raw = scope.protect(Rf_allocVector(SEXPTYPE::RAWSXP, expected as R_xlen_t));
            let decoded = match frame.borrow_mut().take() {
                Some(f) => {
                    let buf: &mut [u8] = if expected == 0 {
                        &mut []
                    } else {
                        std::slice::from_raw_parts_mut(RAW(raw), expected as usize)
                    };
                    decode_into(f, buf)
                }
                None => Err("the checkpoint was read already".into()),
            };
            decoded?;
            let d = scope.protect(r::mk_string(dir));
            r::call_driver(driver, c"restore_state", &[raw, d])?;
            Ok(())
        }
    });
    let captured = console::take();
    done.map_err(|e| {
        let text: String = captured
            .segments
            .iter()
            .filter_map(|s| s.console_text())
            .collect();
        format!("the checkpoint could not be loaded: {e} {}", text.trim())
            .trim()
            .to_string()
    })?;
    Ok(String::new())
}

/// Decompresses the LZ4 frame `frame` into `buf`, which must be exactly
/// the state's size: a frame with less or more is damaged.
fn decode_into(frame: impl Read, buf: &mut [u8]) -> Result<(), String> {
    let mut dec = lz4_flex::frame::FrameDecoder::new(frame);
    dec.read_exact(buf).map_err(|e| {
        format!(
            "the checkpoint is damaged ({e}; the manifest says {} bytes of state)",
            buf.len()
        )
    })?;
    let mut more = [0u8; 1];
    match dec.read(&mut more) {
        Ok(0) => Ok(()),
        Ok(_) => Err(format!(
            "the checkpoint is damaged (more state than the {} bytes its manifest says)",
            buf.len()
        )),
        Err(e) => Err(format!("the checkpoint is damaged ({e})")),
    }
}
