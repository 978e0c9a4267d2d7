//! The differential tests against Rscript (scripts/differential.R;
//! docs/r-semantics.md lists the mismatch classes and why): a fixed
//! sample of R's own examples, the few examples and scripts that set
//! `keep.source` in the middle of a script, and a sample of the corpus,
//! the vignette code installed packages ship. Bounded: 40 snippets, 24
//! vignette scripts.

use rvisor_ffi_tests::TestDir;

/// Runs scripts/differential.R on `which` (a sample size or a list);
/// its table's rows (package, topic, class) and its summary.
fn differential(which: &str) -> (Vec<String>, String) {
    differential_of(&[], which)
}

/// Runs scripts/differential.R with `flags` (`--vignettes`: the corpus)
/// on `which`; its table's rows and its summary.
fn differential_of(flags: &[&str], which: &str) -> (Vec<String>, String) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = TestDir::new("rvisor-diff");
    let tsv = dir.path().join("classes.tsv");
    let out = std::process::Command::new("Rscript")
        .arg(root.join("scripts/differential.R"))
        .args(flags)
        .arg(rvisor_ffi_tests::rvisor_bin())
        .arg(which)
        .arg(&tsv)
        .output()
        .expect("Rscript runs");
    let summary = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{summary}");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = std::fs::read_to_string(&tsv).expect("the table");
    (rows.lines().skip(1).map(str::to_string).collect(), summary)
}

fn matched(row: &str) -> bool {
    row.ends_with("\tmatch") || row.ends_with("\tmatch_but_addresses")
}

#[test]
fn examples_that_set_keep_source_mid_script_match_rscript() {
    // Rscript reads `keep.source` before each top-level expression, so a
    // function defined after `options(keep.source = TRUE)` keeps its
    // source (srcref, srcfile, comments), and one defined without it has
    // none; R's own examples of removeSource() and identical() test it.
    let dir = TestDir::new("rvisor-diff-cases");
    let on = dir.path().join("keep_source_on.R");
    std::fs::write(
        &on,
        "options(keep.source = TRUE)\n\
         f <- function(x) {\n  x + 1 # kept\n}; g <- function() \"\u{e9}\" # too\n\
         f\ng\nattr(f, \"srcref\")\nas.integer(attr(g, \"srcref\"))\n\
         attr(attr(f, \"srcref\"), \"srcfile\")$lines\n\
         names(attributes(body(f)))\n",
    )
    .expect("write a case");
    let off = dir.path().join("keep_source_off.R");
    std::fs::write(
        &off,
        "f <- function(x) {\n  x + 1 # dropped\n}\nf\nattr(f, \"srcref\")\n\
         names(attributes(body(f)))\n",
    )
    .expect("write a case");
    let list = format!(
        "utils/removeSource,base/identical,{},{}",
        on.display(),
        off.display()
    );
    let (rows, summary) = differential(&list);
    assert_eq!(rows.len(), 4, "{summary}");
    for row in &rows {
        assert!(matched(row), "{row}\n{summary}");
    }
}

#[test]
fn a_fixed_sample_of_r_examples_matches_rscript() {
    let (rows, summary) = differential("40");
    let n = rows.len();
    assert!(n >= 30, "only {n} snippets ran:\n{summary}");
    let good = rows.iter().filter(|r| matched(r)).count();
    // Every class of mismatch is documented; most examples must match.
    assert!(
        good * 10 >= n * 7,
        "{good} of {n} matched:\n{}",
        rows.join("\n")
    );
}

/// The classes a corpus script may end in besides `match` and
/// `nondeterministic`: the differences documented as choices
/// (docs/r-semantics.md, "The corpus"), and `program_refused` (a script
/// that runs a program the default allow-list of programs leaves out;
/// scripts/corpus.sh with CORPUS_FLAGS re-checks such scripts with their
/// programs allowed). Tighten by taking a class out.
const CORPUS_ALLOWED: &[&str] = &["device", "gc_counts", "path_widths", "program_refused"];

/// Whether a corpus class is allowed: each part of a combined class
/// (`device+gc_counts`) must be.
fn corpus_allowed(class: &str) -> bool {
    class == "match" || class.split('+').all(|c| CORPUS_ALLOWED.contains(&c))
}

#[test]
fn a_sample_of_installed_vignette_code_matches_rscript() {
    // Code nobody here wrote: the vignette code of whatever packages are
    // installed (scripts/setup.sh installs ggplot2, jsonlite, lintr and
    // R's recommended packages, whose vignettes give well over 10
    // scripts), every k-th of the sorted list, each through Rscript twice
    // and `rvisor run` (confined) in fresh directories.
    let (rows, summary) = differential_of(&["--vignettes"], "24");
    assert!(
        rows.len() >= 10,
        "only {} vignette scripts found (setup.sh's packages ship more):\n{summary}",
        rows.len()
    );
    let classes: Vec<&str> = rows
        .iter()
        .map(|r| r.split('\t').nth(2).expect("package, script, class"))
        .collect();
    let comparable = classes.iter().filter(|c| **c != "nondeterministic").count();
    assert!(
        comparable * 2 >= rows.len(),
        "only {comparable} of {} scripts are comparable:\n{}",
        rows.len(),
        rows.join("\n")
    );
    let bad: Vec<&String> = rows
        .iter()
        .zip(&classes)
        .filter(|(_, c)| **c != "nondeterministic" && !corpus_allowed(c))
        .map(|(r, _)| r)
        .collect();
    assert!(
        bad.is_empty(),
        "scripts that differ from Rscript in an undocumented way (CORPUS_KEEP=DIR \
         keeps both sides):\n{}\n{summary}",
        bad.iter()
            .map(|r| r.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
}
