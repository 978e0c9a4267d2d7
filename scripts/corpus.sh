#!/usr/bin/env bash
# The corpus: the vignette code of every installed package (code nobody
# here wrote), each script through Rscript twice and through `rvisor run`
# (confined) in fresh directories, compared (scripts/differential.R
# --vignettes; docs/r-semantics.md, "The corpus", has the classes). Prints
# the figures: scripts, nondeterministic, comparable, match, each class,
# and the scripts that do not match. About 10 minutes on 2 cores for 84
# scripts with CORPUS_BATCH=1.
#   scripts/corpus.sh [OUT.tsv]    one line per script: package, script, class
#   CORPUS_JOBS=2       scripts run at once
#   CORPUS_KEEP=DIR     both sides of every script that does not match
#   CORPUS_TIMEOUT=120  seconds per run
#   CORPUS_BATCH=1      the scripts through `rvisor batch` too (a column)
#   CORPUS_FLAGS="--allow-program cat --read-only /var/lib/dpkg"
#                       flags for rvisor (programs, paths it may read)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q -p rvisor-cli -p rvisor-worker
exec Rscript scripts/differential.R --vignettes target/debug/rvisor all "${1:-}" "${CORPUS_JOBS:-2}"
