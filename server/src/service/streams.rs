//! Bounds on streamed events waiting for their clients: one per stream
//! and one per tenant (all its open streams together), so that clients
//! that do not read cannot make the server hold their calls' output
//! (docs/streaming.md, "Clients that read slowly, or not at all").

use super::{lock, Service};
use rvisor::{EventFeed, Events, StreamBudget, StreamLimits};

/// Default of [`StreamConfig::per_tenant_bytes`]: 32 MiB, eight streams
/// whose clients stopped reading at their full bound.
pub const DEFAULT_TENANT_STREAM_BUFFER_BYTES: usize = 32 << 20;

/// How many bytes of streamed events may wait for their clients.
///
/// A stream whose client reads more slowly than its call writes keeps
/// what fits and drops the rest, telling the client exactly which events
/// it missed (an event of kind `lagged`); the call goes on at full speed
/// and its result, which holds all of its output, always comes last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamConfig {
    /// One stream (one client's events of one call), in bytes (default
    /// [`rvisor::DEFAULT_STREAM_BUFFER_BYTES`], 4 MiB).
    pub per_stream_bytes: usize,
    /// All open streams of one tenant together, in bytes (default
    /// [`DEFAULT_TENANT_STREAM_BUFFER_BYTES`]; `usize::MAX`: none).
    pub per_tenant_bytes: usize,
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self {
            per_stream_bytes: rvisor::DEFAULT_STREAM_BUFFER_BYTES,
            per_tenant_bytes: DEFAULT_TENANT_STREAM_BUFFER_BYTES,
        }
    }
}

impl Service {
    /// The bounds of a new stream of `tenant`: its own, and the budget it
    /// shares with the tenant's other streams.
    pub fn stream_limits(&self, tenant: &str) -> StreamLimits {
        let cfg = &self.inner.cfg.streams;
        let budget = lock(&self.inner.streams)
            .entry(tenant.to_string())
            .or_insert_with(|| StreamBudget::new(cfg.per_tenant_bytes))
            .clone();
        StreamLimits {
            max_bytes: cfg.per_stream_bytes,
            shared: Some(budget),
        }
    }

    /// A feed for a streamed one-shot run of `tenant`
    /// ([`Service::run_script_streaming`]), under the tenant's bounds.
    pub fn event_feed(&self, tenant: &str) -> (EventFeed, Events) {
        EventFeed::with_limits(&rvisor::ids::execution_id(), self.stream_limits(tenant))
    }

    /// Bytes of streamed events waiting for their clients, of every
    /// tenant together.
    pub fn stream_buffered_bytes(&self) -> usize {
        lock(&self.inner.streams)
            .values()
            .map(StreamBudget::held_bytes)
            .sum()
    }

    /// Health's `streams`: the bounds a client's stream is held to, and
    /// the bytes waiting for clients now.
    pub(super) fn streams_report(&self) -> serde_json::Value {
        let cfg = &self.inner.cfg.streams;
        serde_json::json!({
            "max_bytes_per_stream": cfg.per_stream_bytes,
            "max_bytes_per_tenant": (cfg.per_tenant_bytes != usize::MAX).then_some(cfg.per_tenant_bytes),
            "own_bytes_per_stream": rvisor::STREAM_OWN_BYTES,
            "buffered_bytes": self.stream_buffered_bytes(),
        })
    }

    /// The streams' part of `/metrics`: bytes waiting, open streams,
    /// events dropped and notices given, per tenant and in all.
    pub(super) fn streams_metrics_text(&self) -> String {
        let budgets: Vec<(String, StreamBudget)> = {
            let mut v: Vec<_> = lock(&self.inner.streams)
                .iter()
                .map(|(t, b)| (t.clone(), b.clone()))
                .collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        let mut out = String::new();
        let series: [Series; 4] = [
            (
                "rvisor_stream_buffered_bytes",
                "gauge",
                "Bytes of streamed events waiting for their clients.",
                |b| b.held_bytes() as u64,
            ),
            (
                "rvisor_streams_open",
                "gauge",
                "Streams open (a client following a call's events).",
                |b| b.open_streams() as u64,
            ),
            (
                "rvisor_stream_dropped_events_total",
                "counter",
                "Events dropped for clients that read too slowly (each told by a lagged event).",
                StreamBudget::dropped_events,
            ),
            (
                "rvisor_stream_lagged_total",
                "counter",
                "Lagged events given to clients that read too slowly.",
                StreamBudget::lagged_notices,
            ),
        ];
        for (name, kind, help, value) in series {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            let total: u64 = budgets.iter().map(|(_, b)| value(b)).sum();
            out.push_str(&format!("{name} {total}\n"));
            for (tenant, b) in &budgets {
                out.push_str(&format!(
                    "{name}{{tenant=\"{}\"}} {}\n",
                    label(tenant),
                    value(b)
                ));
            }
        }
        out
    }
}

/// One series of `/metrics`: name, type, help, and its value of a budget.
type Series = (
    &'static str,
    &'static str,
    &'static str,
    fn(&StreamBudget) -> u64,
);

/// A Prometheus label value: backslash, quote and newline escaped.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
