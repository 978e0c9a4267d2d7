#!/usr/bin/env bash
# The chaos test of session ownership (ffi-tests/tests/chaos.rs), long:
# three nodes on a shared store behind nginx, clients incrementing
# counters, a nemesis killing, pausing and draining nodes; prints the
# counts (operations, faults, rollbacks, anomalies) and fails on any
# anomaly. `make test` runs a 40 s round of the same test.
#
#   scripts/chaos.sh                 # 600 s, release build, directory store
#   scripts/chaos.sh 1800 7          # 30 min, seed 7
#   RVISOR_CHAOS_STORE=s3 RVISOR_CHAOS_SESSIONS=8 scripts/chaos.sh 900
#   RVISOR_CHAOS_LOGS=/tmp/chaos-logs scripts/chaos.sh 300   # keep the nodes' logs
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}
seed=${2:-$(date +%s)}
./scripts/setup.sh
cargo build --release --workspace
echo "chaos: ${secs} s, seed ${seed} (rerun with: scripts/chaos.sh ${secs} ${seed})" >&2
RVISOR_CHAOS_SECS="$secs" RVISOR_CHAOS_SEED="$seed" \
  cargo nextest run --release -p rvisor-ffi-tests --test chaos --no-capture 2>&1 |
  grep --line-buffered -E '^chaos:|PASS|FAIL|panicked'
