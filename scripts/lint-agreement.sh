#!/usr/bin/env bash
# Agreement of rvisor-lint with lintr over the whole corpus: lint/tests/corpus
# plus the example code of installed packages' help pages. Prints the
# per-rule precision/recall table and the first disagreements of each rule.
#   RVISOR_LINT_PACKAGES=stats,utils,graphics,base (comma separated)
#   RVISOR_LINT_SHOW=10 (disagreements shown per rule)
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo test -p rvisor-lint --test lintr_agreement full_corpus -- --ignored --nocapture
