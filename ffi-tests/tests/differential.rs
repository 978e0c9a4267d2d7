//! The differential test against Rscript on a fixed sample of R's own
//! examples (scripts/differential.R; docs/r-semantics.md lists the
//! mismatch classes and why). Bounded: 40 snippets.

#[test]
fn a_fixed_sample_of_r_examples_matches_rscript() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let tsv = std::env::temp_dir().join(format!("rvisor-diff-{}.tsv", std::process::id()));
    let out = std::process::Command::new("Rscript")
        .arg(root.join("scripts/differential.R"))
        .arg(rvisor_ffi_tests::rvisor_bin())
        .arg("40")
        .arg(&tsv)
        .output()
        .expect("Rscript runs");
    let summary = String::from_utf8_lossy(&out.stdout);
    eprintln!("{summary}");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = std::fs::read_to_string(&tsv).expect("the table");
    let _ = std::fs::remove_file(&tsv);
    let n = rows.lines().count().saturating_sub(1);
    assert!(n >= 30, "only {n} snippets ran:\n{summary}");
    let matched = rows
        .lines()
        .filter(|l| l.ends_with("\tmatch") || l.ends_with("\tmatch_but_addresses"))
        .count();
    // Every class of mismatch is documented; most examples must match.
    assert!(matched * 10 >= n * 7, "{matched} of {n} matched:\n{rows}");
}
