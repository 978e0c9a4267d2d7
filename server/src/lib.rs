//! rvisor-server: the service around the rvisor library, and its adapters.
//!
//! [`service`] owns what every surface shares: tenants and their sessions,
//! one-shot runs with variables and tables, validation, the limits and
//! timeout policy, the error codes and the metrics. The adapters decode a
//! request, call the service and encode its answer: [`http`] (`rvisor
//! serve`), [`nng`] (`serve --nng`), [`mcp`] (`rvisor mcp`) and [`jsonl`]
//! (`rvisor session --jsonl`). [`tables`] is the table store behind data
//! pointers, kept in
//! the shared [`blob`] store; [`cluster`] holds the node id and the drain
//! state of a node behind a router. [`listen`] keeps the listeners' connection caps, timeouts and
//! shutdown deadline, and the one-server-per-data-directory lock; [`live`]
//! streams a run's events as an HTTP body (SSE or JSON lines); [`heap`]
//! gives what large work freed back to the system.

pub mod admission;
pub mod blob;
pub mod cluster;
pub mod durable;
pub mod heap;
pub mod http;
pub mod jsonl;
pub mod listen;
pub mod live;
pub mod mcp;
pub mod nng;
pub mod service;
pub mod tables;
