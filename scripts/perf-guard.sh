#!/usr/bin/env bash
# The regression guard on the hot paths (run by .ci/run): instructions per
# call of `1+1`, an error, a printed data frame, an lm summary and a base
# plot, and of a new session's worker from its fork to its first result,
# counted by valgrind's callgrind inside the worker's call (stable to
# a few parts in ten thousand from run to run, unlike times on a shared
# machine), against the committed baseline perf/instructions.json. Fails
# when a path's count rose past the margin (3%).
#
#   scripts/perf-guard.sh            # compare (exit 1 on a regression)
#   scripts/perf-guard.sh --update   # write a new baseline: commit it on its
#                                    # own, saying why the cost is wanted
#
# The counts are of the debug build `make test` builds (the worker's R work
# is the same in every build; its Rust part is counted as built).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${RVISOR_BIN:-target/debug/rvisor}
command -v valgrind >/dev/null 2>&1 || { echo "perf-guard: valgrind is missing: run scripts/setup.sh" >&2; exit 2; }
[ -x "$bin" ] || cargo build -p rvisor-cli -p rvisor-worker
if [ "${1:-}" = "--update" ]; then
  exec "$bin" bench --only instructions --baseline perf/instructions.json --update-baseline
fi
exec "$bin" bench --only instructions --baseline perf/instructions.json --margin 0.03
