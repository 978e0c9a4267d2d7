//! The sessions-load report as Markdown.

use super::LoadReport;
use std::collections::BTreeMap;

fn fmt(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| {
        if x < 100.0 {
            format!("{x:.1}")
        } else {
            format!("{x:.0}")
        }
    })
}

/// The report as Markdown.
pub fn table(r: &LoadReport) -> String {
    let mut s = format!(
        "\nsessions-load: {} sessions x {:.1} MB of state, live cap {}, {} clients, {} rounds \
         + a check of every session; {:.0} s in all.\n\n",
        r.sessions,
        r.state_bytes as f64 / 1048576.0,
        r.live_cap.map_or("none".into(), |n| n.to_string()),
        r.clients,
        r.rounds,
        r.wall_seconds
    );
    s.push_str("| figure | value |\n| --- | --- |\n");
    let mut row = |k: &str, v: String| s.push_str(&format!("| {k} | {v} |\n"));
    row("calls (ok / made)", format!("{} / {}", r.calls_ok, r.calls));
    row("failures", r.failures.to_string());
    row("lost sessions (target 0)", r.lost_sessions.to_string());
    row(
        "retried: 429 / 503 / unreachable / cut by the restart",
        format!(
            "{} / {} / {} / {}",
            r.retried_429, r.retried_503, r.retried_unreachable, r.cut_by_restart
        ),
    );
    for (name, l) in [
        (
            "create (new session + state) ms p50 / p95 / p99",
            &r.latency_create,
        ),
        ("call to a live session ms p50 / p95 / p99", &r.latency_live),
        (
            "call that restored the session ms p50 / p95 / p99",
            &r.latency_restored,
        ),
        (
            "the same with retries ms p50 / p95 / p99",
            &r.latency_restored_with_retries,
        ),
    ] {
        row(
            name,
            format!(
                "{} / {} / {} (n {})",
                fmt(l.p50_ms),
                fmt(l.p95_ms),
                fmt(l.p99_ms),
                l.n
            ),
        );
    }
    let reasons = |m: &BTreeMap<String, u64>| {
        if m.is_empty() {
            "-".to_string()
        } else {
            m.iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    row("restored results by reason", reasons(&r.restored_by_reason));
    row(
        "results after a worker was replaced, by reset_reason",
        reasons(&r.reset_by_reason),
    );
    let m = &r.memory;
    row(
        "workers' memory max: PSS sum / health (MB)",
        format!(
            "{:.0} / {} ({} processes at most, {} samples)",
            m.max_workers_pss_mb,
            fmt(m.max_admission_memory_mb),
            m.max_worker_processes,
            m.samples
        ),
    );
    row(
        "memory budget (MB)",
        match (m.budget_mb, m.within_budget) {
            (Some(b), Some(true)) => format!("{b}: within"),
            (Some(b), _) => format!("{b}: EXCEEDED"),
            (None, _) => "none".into(),
        },
    );
    row(
        "live sessions max (health)",
        m.max_admission_live.map_or("-".into(), |n| n.to_string()),
    );
    if let Some(x) = &r.restart {
        row(
            "restart: SIGTERM to exit / start to ready (ms)",
            format!(
                "{:.0} / {:.0} ({} calls in flight; {})",
                x.sigterm_to_exit_ms, x.start_to_ready_ms, x.calls_in_flight, x.exit_status
            ),
        );
        row("first call after the restart", reasons(&x.first_call_after));
    }
    row(
        "state directory, largest (MB)",
        format!("{:.0}", r.state_dir_mb),
    );
    for f in r.failure_list.iter().take(10) {
        s.push_str(&format!(
            "\n- session {} ({}): {}",
            f.session, f.phase, f.error
        ));
    }
    if !r.failure_list.is_empty() {
        s.push('\n');
    }
    s
}
