//! `rvisor bench`: latency of rvisor's own paths, measured in one run.
//!
//! Each workload is run many times; the table shows median, p90 and p99.
//! Peers (Rscript, callr, Rserve) join this table in a later step; for now
//! it measures rvisor alone so changes to the hot path can be compared.

use crate::{CallOptions, Outcome, Worker, WorkerConfig};
use serde::Serialize;
use std::time::{Duration, Instant};

/// Summary of one workload.
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    /// Workload name.
    pub workload: String,
    /// Samples taken.
    pub n: usize,
    /// Median, milliseconds.
    pub median_ms: f64,
    /// 90th percentile, milliseconds.
    pub p90_ms: f64,
    /// 99th percentile, milliseconds.
    pub p99_ms: f64,
}

fn stats(workload: &str, mut samples: Vec<Duration>) -> Stats {
    samples.sort();
    let pick = |q: f64| {
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples[i].as_secs_f64() * 1000.0
    };
    Stats {
        workload: workload.into(),
        n: samples.len(),
        median_ms: pick(0.5),
        p90_ms: pick(0.9),
        p99_ms: pick(0.99),
    }
}

fn time_calls(
    w: &mut Worker,
    code: &str,
    n: usize,
    opts: &CallOptions,
) -> Result<Vec<Duration>, String> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let r = w.run(code, opts);
        out.push(t.elapsed());
        if r.outcome != Outcome::Complete {
            return Err(format!("`{code}` ended with {}: {}", r.outcome, r.console));
        }
    }
    Ok(out)
}

/// Runs the workloads; `quick` takes fewer samples.
pub fn run(quick: bool) -> Result<Vec<Stats>, String> {
    let scale = if quick { 1 } else { 5 };
    let cfg = WorkerConfig::default();
    let opts = CallOptions::default();
    let mut results = Vec::new();

    let mut starts = Vec::new();
    for _ in 0..(4 * scale) {
        let t = Instant::now();
        let w = Worker::spawn(&cfg).map_err(|e| e.to_string())?;
        starts.push(t.elapsed());
        w.shutdown(Duration::from_secs(1));
    }
    results.push(stats("worker start-up (spawn + R init)", starts));

    let mut w = Worker::spawn(&cfg).map_err(|e| e.to_string())?;
    time_calls(&mut w, "1+1", 50, &opts)?; // warm
    results.push(stats("1+1", time_calls(&mut w, "1+1", 400 * scale, &opts)?));
    w.run("x <- 0", &opts);
    results.push(stats(
        "x <- x + 1",
        time_calls(&mut w, "x <- x + 1", 400 * scale, &opts)?,
    ));
    results.push(stats(
        "summary(colMeans(matrix(rnorm(1e6),1000)))",
        time_calls(
            &mut w,
            "summary(colMeans(matrix(rnorm(1e6),1000)))",
            20 * scale,
            &opts,
        )?,
    ));
    w.run(
        "df <- data.frame(a = 1:2000, b = rnorm(2000), c = sample(letters, 2000, TRUE))",
        &opts,
    );
    results.push(stats(
        "print 2,000-row data frame",
        time_calls(&mut w, "print(df)", 10 * scale, &opts)?,
    ));
    let plot_opts = CallOptions {
        plot_width: 800,
        plot_height: 600,
        ..CallOptions::default()
    };
    time_calls(&mut w, "plot(1:10)", 3, &plot_opts)?;
    results.push(stats(
        "base plot to PNG (800x600)",
        time_calls(&mut w, "plot(rnorm(100))", 20 * scale, &plot_opts)?,
    ));
    Ok(results)
}

/// Renders results as a table.
pub fn table(results: &[Stats]) -> String {
    let mut s = format!(
        "{:<45} {:>6} {:>10} {:>10} {:>10}\n",
        "workload", "n", "median ms", "p90 ms", "p99 ms"
    );
    for r in results {
        s.push_str(&format!(
            "{:<45} {:>6} {:>10.3} {:>10.3} {:>10.3}\n",
            r.workload, r.n, r.median_ms, r.p90_ms, r.p99_ms
        ));
    }
    s
}
