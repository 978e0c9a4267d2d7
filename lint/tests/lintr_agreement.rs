//! Agreement with lintr: runs lintr 3's default linters (through Rscript,
//! `tests/lintr.R`) and this crate over a corpus and reports, per rule,
//! precision and recall of this crate's notes against lintr's (a note
//! matches when file, line, column, rule and message are the same).
//!
//! - `fixed_sample` (always): the files under `tests/corpus/`, written to
//!   hit each rule; asserts the targets. Skipped with a message when
//!   Rscript or lintr is missing (outside CI; in CI it fails).
//! - `full_corpus` (ignored; `scripts/lint-agreement.sh` runs it): those
//!   files plus the example code of installed packages' help pages
//!   (`tests/examples.R`; packages from `RVISOR_LINT_PACKAGES`, comma
//!   separated, default stats, utils, graphics, base).
//!
//! Files lintr cannot parse are left out (syntax errors are R's parser's to
//! report, not a style engine's). So are lintr's rules this crate does not
//! cover (`object_usage_linter`, `cyclocomp_linter`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

type Key = (String, u32, u32, String, String);

/// Precision target for every covered rule.
const PRECISION: f64 = 0.95;
/// Recall target for every covered rule.
const RECALL: f64 = 0.90;

fn here() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn lintr_available() -> bool {
    Command::new("Rscript")
        .args([
            "-e",
            "if (!requireNamespace('lintr', quietly = TRUE)) quit(status = 1)",
        ])
        .status()
        .is_ok_and(|s| s.success())
}

fn r_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "R"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// lintr's notes for `files`, and the files it could not parse (one
/// Rscript per core, each on a share of the files).
fn lintr(files: &[PathBuf]) -> (BTreeSet<Key>, BTreeSet<String>) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = files.len().div_ceil(cores).max(1);
    let outputs: Vec<String> = std::thread::scope(|s| {
        let jobs: Vec<_> = files
            .chunks(per)
            .map(|chunk| {
                s.spawn(move || {
                    let out = Command::new("Rscript")
                        .arg(here().join("tests/lintr.R"))
                        .args(chunk)
                        .output()
                        .expect("run Rscript");
                    assert!(
                        out.status.success(),
                        "lintr failed: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    String::from_utf8_lossy(&out.stdout).into_owned()
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| j.join().expect("lintr thread"))
            .collect()
    });
    let mut notes = BTreeSet::new();
    let mut broken = BTreeSet::new();
    for line in outputs.iter().flat_map(|o| o.lines()) {
        let f: Vec<&str> = line.splitn(5, '\t').collect();
        if f.len() != 5 {
            continue;
        }
        let (file, rule) = (f[0].to_string(), f[3].to_string());
        if rule == "error" || rule == "lintr_failed" {
            broken.insert(file);
            continue;
        }
        if !rvisor_lint::RULES.contains(&rule.as_str()) {
            continue;
        }
        let (Ok(l), Ok(c)) = (f[1].parse(), f[2].parse()) else {
            continue;
        };
        notes.insert((file, l, c, rule, f[4].to_string()));
    }
    (notes, broken)
}

fn ours(files: &[PathBuf], skip: &BTreeSet<String>) -> BTreeSet<Key> {
    let mut notes = BTreeSet::new();
    for f in files {
        let name = f.display().to_string();
        if skip.contains(&name) {
            continue;
        }
        let Ok(bytes) = std::fs::read(f) else {
            continue;
        };
        let text = String::from_utf8_lossy(&bytes);
        for n in rvisor_lint::lint(&text) {
            notes.insert((name.clone(), n.line, n.column, n.rule, n.message));
        }
    }
    notes
}

#[derive(Default, Debug)]
struct Counts {
    both: usize,
    only_ours: usize,
    only_lintr: usize,
}

impl Counts {
    fn precision(&self) -> f64 {
        ratio(self.both, self.both + self.only_ours)
    }
    fn recall(&self) -> f64 {
        ratio(self.both, self.both + self.only_lintr)
    }
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 {
        1.0
    } else {
        a as f64 / b as f64
    }
}

/// Compares, prints the per-rule table and up to `show` disagreements per
/// rule, and returns the rules that miss a target (with at least `min`
/// notes on either side).
fn compare(files: &[PathBuf], show: usize, min: usize) -> Vec<String> {
    let (theirs, broken) = lintr(files);
    let theirs: BTreeSet<Key> = theirs
        .into_iter()
        .filter(|k| !broken.contains(&k.0))
        .collect();
    let mine = ours(files, &broken);
    let mut by_rule: BTreeMap<&str, Counts> = BTreeMap::new();
    for r in rvisor_lint::RULES {
        by_rule.insert(r, Counts::default());
    }
    let mut diffs: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for k in mine.union(&theirs) {
        let c = by_rule.entry(k.3.as_str()).or_default();
        let tag = match (mine.contains(k), theirs.contains(k)) {
            (true, true) => {
                c.both += 1;
                continue;
            }
            (true, false) => {
                c.only_ours += 1;
                "extra"
            }
            _ => {
                c.only_lintr += 1;
                "missed"
            }
        };
        diffs
            .entry(k.3.clone())
            .or_default()
            .push(format!("  {tag} {}:{}:{} {}", k.0, k.1, k.2, k.4));
    }
    println!(
        "{} files ({} left out: lintr could not parse them)",
        files.len() - broken.len(),
        broken.len()
    );
    println!("| rule | both | only rvisor-lint | only lintr | precision | recall |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    let mut total = Counts::default();
    let mut failing = Vec::new();
    for (rule, c) in &by_rule {
        println!(
            "| {rule} | {} | {} | {} | {:.1}% | {:.1}% |",
            c.both,
            c.only_ours,
            c.only_lintr,
            100.0 * c.precision(),
            100.0 * c.recall()
        );
        total.both += c.both;
        total.only_ours += c.only_ours;
        total.only_lintr += c.only_lintr;
        let n = c.both + c.only_ours.max(c.only_lintr);
        if n >= min && (c.precision() < PRECISION || c.recall() < RECALL) {
            failing.push(rule.to_string());
        }
    }
    println!(
        "| all | {} | {} | {} | {:.1}% | {:.1}% |",
        total.both,
        total.only_ours,
        total.only_lintr,
        100.0 * total.precision(),
        100.0 * total.recall()
    );
    for (rule, d) in &diffs {
        println!("{rule}: {} disagreements", d.len());
        for l in d.iter().take(show) {
            println!("{l}");
        }
    }
    failing
}

#[test]
fn fixed_sample() {
    if !lintr_available() {
        assert!(
            std::env::var_os("CI").is_none(),
            "Rscript with lintr is needed in CI"
        );
        eprintln!("skipped: Rscript with lintr is not installed");
        return;
    }
    let files = r_files(&here().join("tests/corpus"));
    assert!(!files.is_empty());
    let failing = compare(&files, 20, 1);
    assert!(failing.is_empty(), "rules below target: {failing:?}");
}

#[test]
#[ignore = "minutes: lintr over the example code of installed packages; scripts/lint-agreement.sh"]
fn full_corpus() {
    assert!(lintr_available(), "Rscript with lintr is needed");
    let dir = std::env::temp_dir().join(format!("rvisor-lint-corpus-{}", std::process::id()));
    let pkgs = std::env::var("RVISOR_LINT_PACKAGES")
        .unwrap_or_else(|_| "stats,utils,graphics,base".into());
    let status = Command::new("Rscript")
        .arg(here().join("tests/examples.R"))
        .arg(&dir)
        .args(pkgs.split(','))
        .status()
        .expect("run Rscript");
    assert!(status.success());
    let mut files = r_files(&here().join("tests/corpus"));
    files.extend(r_files(&dir));
    let show = std::env::var("RVISOR_LINT_SHOW")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let failing = compare(&files, show, 20);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failing.is_empty(), "rules below target: {failing:?}");
}
