//! Checkpoints: a session's state written to a file the supervisor passes
//! (as a descriptor: a confined worker cannot open host paths), and read
//! back into a fresh worker. The driver (`checkpoint_state`,
//! `restore_state`) gathers and applies the state as one serialised R
//! object; this module compresses it (LZ4 frames, with a content checksum,
//! so a damaged file is refused) and writes the manifest.
//!
//! The file's layout is `rvisor_protocol::checkpoint`'s.
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
use std::io::{Read, Write};

use rvisor_protocol::checkpoint::{split, MAGIC};

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

/// Writes the session's state into `out`; `Ok`: the manifest (JSON text).
pub fn checkpoint(
    r: &R,
    out: File,
    working_dir: Option<String>,
    max_file_bytes: u64,
) -> Result<String, String> {
    let dir = state_dir(working_dir);
    if let Some(why) = r::string_problem(&dir) {
        return Err(format!("the working directory cannot be saved: {why}"));
    }
    console::begin(1 << 20);
    let driver = r.driver;
    let (dir, out) = (&dir[..], &out);
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
            Ok((compress_into(out, bytes), n, objects_bytes, texts))
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
    let mut out = out;
    out.write_all(manifest.as_bytes())
        .and_then(|_| out.write_all(&(manifest.len() as u32).to_be_bytes()))
        .and_then(|_| out.flush())
        .map_err(|e| format!("could not write the checkpoint: {e}"))?;
    Ok(manifest)
}

/// Writes the magic and `state` as one LZ4 frame into `out`; returns the
/// compressed size. The manifest follows (see [`split`]).
fn compress_into(out: &File, state: &[u8]) -> Result<u64, String> {
    let mut w = std::io::BufWriter::with_capacity(1 << 20, out);
    w.write_all(MAGIC).map_err(|e| e.to_string())?;
    let mut enc = lz4_flex::frame::FrameEncoder::with_frame_info(
        lz4_flex::frame::FrameInfo::new()
            .content_checksum(true)
            .content_size(Some(state.len() as u64)),
        w,
    );
    enc.write_all(state)
        .map_err(|e| format!("could not write the checkpoint: {e}"))?;
    let mut w = enc
        .finish()
        .map_err(|e| format!("could not write the checkpoint: {e}"))?;
    w.flush()
        .map_err(|e| format!("could not write the checkpoint: {e}"))?;
    let compressed = w
        .get_ref()
        .metadata()
        .map(|m| m.len().saturating_sub(MAGIC.len() as u64))
        .unwrap_or(0);
    Ok(compressed)
}

/// Reads a checkpoint from `input` and loads it into this worker.
pub fn restore(r: &R, mut input: File, working_dir: Option<String>) -> Result<String, String> {
    let mut all = Vec::new();
    input
        .read_to_end(&mut all)
        .map_err(|e| format!("could not read the checkpoint: {e}"))?;
    let (manifest, frame) = split(&all)?;
    let m: serde_json::Value = serde_json::from_slice(manifest)
        .map_err(|e| format!("the checkpoint's manifest is damaged ({e})"))?;
    let version = m["r_version"].as_str().unwrap_or("");
    if version != r.version {
        return Err(format!(
            "the checkpoint was taken with R {version} and this worker runs R {}",
            r.version
        ));
    }
    let expected = m["state_bytes"].as_u64().unwrap_or(0) as usize;
    let mut state = Vec::with_capacity(expected);
    lz4_flex::frame::FrameDecoder::new(frame)
        .read_to_end(&mut state)
        .map_err(|e| format!("the checkpoint is damaged ({e})"))?;
    if state.len() != expected {
        return Err(format!(
            "the checkpoint is damaged ({} bytes of state, the manifest says {expected})",
            state.len()
        ));
    }
    let dir = state_dir(working_dir);
    if let Some(why) = r::string_problem(&dir) {
        return Err(format!("the working directory cannot be restored: {why}"));
    }
    console::begin(1 << 20);
    let driver = r.driver;
    let (dir, state) = (&dir[..], &state[..]);
    // SAFETY: called on the R thread (serve's loop), after R started.
    let tok = unsafe { RThread::assume() };
    let done = r::protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; the raw vector is
        // allocated with the state's length and filled before use; every
        // argument is protected by `scope`.
        unsafe {
            let raw = scope.protect(Rf_allocVector(SEXPTYPE::RAWSXP, state.len() as R_xlen_t));
            if !state.is_empty() {
                std::ptr::copy_nonoverlapping(state.as_ptr(), RAW(raw), state.len());
            }
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
