//! `input_request`: R's `readline()`, `menu()` and `askYesNo()` in the
//! kernel's session ask the front end through the stdin socket.
//!
//! The kernel's session offers the host tool [`INPUT_TOOL`]; the driver
//! (embedded-worker, `install_input`) makes those three functions call it
//! in sessions that have it (`interactive()` stays FALSE, and other
//! surfaces, whose sessions lack the tool, keep R's own non-interactive
//! behaviour). The tool's handler runs on a thread of the worker's call
//! loop, so the call's timeout and interrupts go on while it waits: it
//! sends `input_request` to the front end of the running cell and waits
//! for its `input_reply`, until the cell ends (an interrupt, a timeout,
//! a kill), whichever comes first. docs/jupyter.md, "Input".

use crate::sockets;
use crate::wire::{Message, Signer};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The host tool R's input functions call.
pub const INPUT_TOOL: &str = "rvisor.input";

/// How often a waiting input looks whether its cell has ended, ms.
const WAIT_MS: i64 = 50;

/// Most bytes of one answer given to R (the tool's result cap is larger;
/// a line typed into a notebook is far smaller).
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// The stdin side of the kernel, shared by the shell loop (which says
/// which cell runs) and the tool's handler (which asks).
#[derive(Clone, Default)]
pub struct Input {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    /// The stdin socket and the signer, once the kernel has bound it;
    /// locked by the one handler asking at a time.
    socket: Mutex<Option<(zmq::Socket, Signer)>>,
    /// The cell running now: its request and whether its front end
    /// allows input.
    cell: Mutex<Option<(Message, bool)>>,
    /// Counts cells begun: a handler whose cell has ended stops waiting.
    generation: AtomicU64,
    /// Where the kernel's messages go (its thread's, when it attached).
    log: Mutex<crate::log::Log>,
}

impl std::fmt::Debug for Input {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Input").finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The tool [`INPUT_TOOL`] with the handler `ask`.
fn input_tool(
    ask: impl Fn(&rvisor::ToolCall) -> Result<Value, String> + Send + Sync + 'static,
) -> rvisor::Tool {
    rvisor::Tool::new(
        INPUT_TOOL,
        "asks the Jupyter front end for a line of input (readline(), menu(), askYesNo())",
        json!({"type": "object", "properties": {
            "prompt": {"type": "string"}, "password": {"type": "boolean"}}}),
        ask,
    )
    .expect("the input tool's name is valid")
}

impl Input {
    /// The host tool for the kernel's session (give it to the session's
    /// options before the service makes the session).
    pub fn tool(&self) -> rvisor::Tool {
        let me = self.clone();
        input_tool(move |call| me.ask(&call.args))
    }

    /// The kernel has bound its stdin socket.
    pub(crate) fn attach(&self, socket: zmq::Socket, signer: Signer) {
        *lock(&self.inner.socket) = Some((socket, signer));
        *lock(&self.inner.log) = crate::log::Log::current();
    }

    /// The kernel is closing: its stdin socket is dropped (so its port is
    /// free once the kernel's other sockets are).
    pub(crate) fn detach(&self) {
        lock(&self.inner.socket).take();
    }

    /// A cell starts: `parent` is its `execute_request`, `allow` its
    /// `allow_stdin`.
    pub(crate) fn begin_cell(&self, parent: &Message, allow: bool) {
        self.inner.generation.fetch_add(1, Ordering::SeqCst);
        *lock(&self.inner.cell) = Some((parent.clone(), allow));
    }

    /// The cell has ended: an input still waiting stops.
    pub(crate) fn end_cell(&self) {
        self.inner.generation.fetch_add(1, Ordering::SeqCst);
        *lock(&self.inner.cell) = None;
    }

    /// The tool's handler: `input_request` with the prompt, the answer's
    /// `value` as R's string.
    fn ask(&self, args: &Value) -> Result<Value, String> {
        // On the session's thread: the kernel's messages still go to it.
        lock(&self.inner.log).clone().enter();
        let prompt = args["prompt"].as_str().unwrap_or("");
        let password = args["password"].as_bool().unwrap_or(false);
        let generation = self.inner.generation.load(Ordering::SeqCst);
        let Some((parent, allow)) = lock(&self.inner.cell).clone() else {
            return Err("no cell is running, so there is no front end to ask".into());
        };
        if !allow {
            return Err(
                "this cell's front end does not take input (its execute_request \
                        has allow_stdin false, as nbclient and most executors send); \
                        put the value in the code instead"
                    .into(),
            );
        }
        let guard = lock(&self.inner.socket);
        let Some((sock, signer)) = guard.as_ref() else {
            return Err("the kernel's stdin socket is not open".into());
        };
        // Answers to an earlier request that ended unanswered are stale.
        while let Ok(Some(_)) = sockets::recv(sock, "stdin", 0, None) {}
        let request = parent.reply(
            "input_request",
            json!({"prompt": prompt, "password": password}),
        );
        sockets::send(sock, "stdin", &request, signer);
        loop {
            if self.inner.generation.load(Ordering::SeqCst) != generation {
                return Err("the cell ended before the front end answered".into());
            }
            let frames = match sockets::recv(sock, "stdin", WAIT_MS, None) {
                Ok(Some(f)) => f,
                Ok(None) => continue,
                Err(e) => return Err(format!("the stdin socket failed: {e}")),
            };
            let Some(reply) = crate::decode(frames, signer, "stdin") else {
                continue;
            };
            let asked = &request.header["msg_id"];
            let answers = &reply.parent_header["msg_id"];
            if answers.is_string() && answers != asked {
                continue; // the answer to an earlier request
            }
            if reply.msg_type() != "input_reply" {
                crate::log::say(&format!(
                    "rvisor kernel: ignored a {} on stdin (waiting for input_reply)",
                    reply.msg_type()
                ));
                continue;
            }
            let value = reply.content["value"].as_str().unwrap_or("");
            if value.len() > MAX_ANSWER_BYTES {
                return Err(format!(
                    "the answer is {} bytes, over the {MAX_ANSWER_BYTES} bytes one input may \
                     have; read large data from a file instead",
                    value.len()
                ));
            }
            return Ok(Value::String(value.to_string()));
        }
    }
}

/// The input tool of a kernel host, whose kernels share one supervisor and
/// so one set of session defaults: one tool, which asks the front end of
/// the kernel whose session called it (each kernel's [`Input`] registered
/// by its session's id).
#[derive(Clone, Default)]
pub struct InputRouter {
    kernels: Arc<Mutex<HashMap<String, Input>>>,
}

impl std::fmt::Debug for InputRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InputRouter").finish_non_exhaustive()
    }
}

impl InputRouter {
    /// The host tool for every kernel session of the host.
    pub fn tool(&self) -> rvisor::Tool {
        let me = self.clone();
        input_tool(move |call| {
            let input = lock(&me.kernels).get(&call.session_id).cloned();
            match input {
                Some(i) => i.ask(&call.args),
                None => Err("this session has no Jupyter front end to ask".into()),
            }
        })
    }

    /// Kernel `session_id`'s input, until [`InputRouter::remove`].
    pub fn insert(&self, session_id: &str, input: Input) {
        lock(&self.kernels).insert(session_id.to_string(), input);
    }

    /// The kernel of `session_id` has ended.
    pub fn remove(&self, session_id: &str) {
        lock(&self.kernels).remove(session_id);
    }
}
