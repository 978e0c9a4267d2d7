//! The displays rows of `rvisor bench` (`--only displays`): the same calls
//! with displays on and off in one session, interleaved round by round, so
//! the difference is what displays cost: `1+1`, an explicit `print()` of a
//! 2,000-row data frame (text either way), the same frame visible (its
//! display made), and a 1e6-row one (its added time, and the bytes of its
//! display).

use super::{ms, summarise, Stats};
use rvisor::{DisplayOptions, Outcome, RunOptions, Supervisor, SupervisorConfig};
use std::time::{Duration, Instant};

/// The rows: per workload, `on` and `off`, then the 1e6-row display's bytes.
pub fn run(quick: bool, progress: &mut dyn FnMut(&str)) -> Result<Vec<Stats>, String> {
    let rounds = if quick { 3 } else { 10 };
    let sup = Supervisor::new(SupervisorConfig::default()).map_err(|e| e.to_string())?;
    progress("displays: starting the zygote");
    sup.pool().wait_ready(Duration::from_secs(120));
    let s = sup.session().map_err(|e| e.to_string())?;
    for code in [
        "dat <- data.frame(a = 1:2000, b = rnorm(2000), c = sample(letters, 2000, TRUE))",
        "big <- data.frame(a = seq_len(1e6), b = rnorm(1e6), c = sample(letters, 1e6, TRUE))",
        // repr and jsonlite loaded once, as any session that shows a table.
        "data.frame(a = 1)",
    ] {
        s.run(code).map_err(|e| e.to_string())?.wait();
    }
    let on = RunOptions::default();
    let off = RunOptions {
        display: DisplayOptions {
            enabled: Some(false),
            ..DisplayOptions::default()
        },
        ..RunOptions::default()
    };
    let workloads: [(&str, &str, usize); 4] = [
        ("display_one_plus_one", "1+1", 100),
        // An explicit print() is text with displays on too (docs/output-
        // and-plots.md): the same call with and without them.
        ("display_print_2000", "print(dat)", 10),
        ("display_df_2000", "dat", 10),
        ("display_df_1e6", "big", 5),
    ];
    let mut samples = vec![[Vec::new(), Vec::new()]; workloads.len()];
    let mut bytes = Vec::new();
    for round in 0..rounds {
        progress(&format!("displays: round {}/{rounds}", round + 1));
        for (wi, (_, code, n)) in workloads.iter().enumerate() {
            for (oi, opts) in [&on, &off].into_iter().enumerate() {
                for _ in 0..*n {
                    let t = Instant::now();
                    let r = s.run_with(code, opts).map_err(|e| e.to_string())?.wait();
                    samples[wi][oi].push(ms(t.elapsed()));
                    if !matches!(r.outcome, Outcome::Complete) {
                        return Err(format!("`{code}` ended with {}: {}", r.outcome, r.console));
                    }
                    if *code == "big" && oi == 0 && bytes.is_empty() {
                        let json = serde_json::to_string(&r.displays).unwrap_or_default();
                        bytes.push(json.len());
                    }
                }
            }
        }
    }
    let mut out = Vec::new();
    for (wi, (id, code, _)) in workloads.iter().enumerate() {
        let [a, b] = std::mem::take(&mut samples[wi]);
        let med = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(|x, y| x.total_cmp(y));
            v.get(v.len() / 2).copied().unwrap_or(0.0)
        };
        let added = med(&a) - med(&b);
        let mut note = format!("`{code}` with displays on; off beside it; added {added:.2} ms");
        if *code == "big" {
            note.push_str(&format!(
                "; its display {} bytes of JSON",
                bytes.first().copied().unwrap_or(0)
            ));
        }
        out.push(summarise(&format!("{id}_on"), "rvisor", a, Some(note)));
        out.push(summarise(
            &format!("{id}_off"),
            "rvisor",
            b,
            Some(format!("`{code}` with displays off")),
        ));
    }
    sup.shutdown();
    Ok(out)
}
