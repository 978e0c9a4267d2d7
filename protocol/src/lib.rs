//! Wire types of rvisor and the frame codec that carries them.
//!
//! Every surface (library, CLI, JSONL, HTTP, MCP, nng) speaks the shapes
//! defined here, so the contract in `CONTRACT.md` is written down once. The
//! crate has no R and no I/O runtime: host programs may depend on it alone.

pub mod artifact;
pub mod checkpoint;
pub mod display;
pub mod event;
pub mod fdpass;
pub mod frame;
pub mod names;
pub mod result;
pub mod timing;
pub mod worker;
pub mod zygote;

pub use artifact::Artifact;
pub use display::{Display, DisplayOptions, PlotFormat};
pub use event::*;
pub use frame::{read_frame, write_frame, FrameDecoder, FrameError, MAX_FRAME_BYTES};
pub use result::*;
pub use worker::*;
pub use zygote::*;

/// Version of the supervisor <-> worker frame protocol. Bump on every
/// incompatible change of [`ToWorker`], [`FromWorker`], [`ToZygote`] or
/// [`FromZygote`]; the hello exchange refuses a worker (or zygote) built
/// with another version.
pub const PROTOCOL_VERSION: u32 = 6;

/// Version of the [`RunResult`] schema (the `schema_version` field).
pub const SCHEMA_VERSION: u32 = 1;

/// Default plot size in pixels.
pub const DEFAULT_PLOT_WIDTH: u32 = 1000;
/// Default plot size in pixels.
pub const DEFAULT_PLOT_HEIGHT: u32 = 650;
/// Largest plot side accepted, in pixels.
pub const MAX_PLOT_SIDE: u32 = 4096;
/// How long a forked worker waits idle after calls before it gives back
/// its copies of its zygote's heap pages that are unchanged (the worker's
/// heap_image.rs; docs/process-model.md, "Memory"), in milliseconds.
/// Calls a few seconds apart keep their pages: after a give-back a
/// session's next calls copy the pages they write again, which made an
/// error and the next call ~2x slower for the next 50 pairs.
pub const GIVE_BACK_IDLE_MS: u32 = 5000;
/// Default cap on the output of one call (console text and plots), in bytes.
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 8 * 1024 * 1024;
