#!/usr/bin/env bash
# Fuzzes the HTTP contract: starts `rvisor serve` (confined workers, a
# temporary token file, data and state dirs, a free loopback port) and runs
# schemathesis with all its checks against the server's own
# /v1/openapi.json, bounded in examples, per-request time and total time.
# Any failure exits non-zero. Needs `cargo build --workspace` first (make
# test does it) and schemathesis (scripts/setup.sh installs it).
#
# FUZZ_EXAMPLES is schemathesis' --max-examples: test cases per operation
# in its fuzzing phase; the coverage and stateful phases add their own, so
# the closing count ("N passed") is of every test case, ~1300 at 50 here.
#
#   scripts/fuzz-openapi.sh            # the bounded run of `make test` (~25 s here)
#   FUZZ_EXAMPLES=200 FUZZ_SEED=7 FUZZ_TIMEOUT=600 scripts/fuzz-openapi.sh   # a longer look
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
bin=${RVISOR_BIN:-$root/target/debug/rvisor}
examples=${FUZZ_EXAMPLES:-50}
# A fixed seed by default: the same cases on every run, so a failure is
# reproducible and `make test` is not flaky; set FUZZ_SEED to explore.
seed=${FUZZ_SEED:-20261201}
# The whole schemathesis run, seconds (the step stays under ~3 minutes).
budget=${FUZZ_TIMEOUT:-170}

fail() { echo "fuzz-openapi: $*" >&2; exit 2; }
[ -x "$bin" ] || fail "$bin is missing: run cargo build --workspace first"
command -v python3 >/dev/null 2>&1 || fail "python3 is missing: install it, then run scripts/setup.sh"
# As a module: pip may put the `schemathesis` command outside PATH.
st=(python3 -m schemathesis.cli)
"${st[@]}" --version >/dev/null 2>&1 || fail "schemathesis is missing: run scripts/setup.sh"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/rvisor-fuzz.XXXXXX")
pid=""
cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    # Graceful shutdown lets requests in flight finish; do not wait forever.
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

token=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
echo "$token fuzz" >"$tmp/tokens"
# Port 0: the kernel picks a free port, and the server prints it.
# A state directory: the checkpoint, hibernate and restore operations are
# offered (and documented) only by a server that keeps checkpoints.
"$bin" serve --tokens "$tmp/tokens" --operator fuzz --listen 127.0.0.1:0 --data-dir "$tmp/data" \
  --state-dir "$tmp/state" --style builtin >"$tmp/server.log" 2>&1 &
pid=$!

base=""
for _ in $(seq 300); do
  kill -0 "$pid" 2>/dev/null || { cat "$tmp/server.log" >&2; fail "the server exited at start (log above)"; }
  base=$(sed -n 's/^rvisor serve: listening on \(http:[^ ]*\)$/\1/p' "$tmp/server.log" | head -n1)
  [ -n "$base" ] && break
  sleep 0.1
done
[ -n "$base" ] || { cat "$tmp/server.log" >&2; fail "the server did not say where it listens within 30 s"; }

# Healthy means the zygote answered: GET /v1/health with the token.
python3 - "$base" "$token" <<'PY' || { cat "$tmp/server.log" >&2; fail "/v1/health did not answer 200 within 60 s (server log above)"; }
import sys, time, urllib.request
base, token = sys.argv[1], sys.argv[2]
deadline = time.time() + 60
while True:
    try:
        req = urllib.request.Request(base + "/v1/health", headers={"Authorization": "Bearer " + token})
        with urllib.request.urlopen(req, timeout=10) as r:
            if r.status == 200:
                break
    except Exception:
        pass
    if time.time() > deadline:
        sys.exit(1)
    time.sleep(0.2)
PY

echo "fuzz-openapi: server at $base; schemathesis: all checks, $examples examples per operation, seed $seed, at most ${budget} s" >&2
start=$(date +%s)
set +e
# Every check runs on every operation (the default; scripts/schemathesis.toml
# declares the one rule no schema can state, a table file's content, for
# POST /v1/tables, and leaves out the drain).
# --workers 1: two cores, and R runs behind the requests.
# --request-timeout: a random script may loop until its own timeout (the
#   server's default, seconds): a longer wait than that is a hang.
# From the temporary directory: schemathesis keeps a cache of past failures
# (.schemathesis/) in its working directory and replays it; each run here
# starts clean.
(cd "$tmp" && timeout --kill-after=10 "$budget" "${st[@]}" --config-file "$root/scripts/schemathesis.toml" \
  run "$base/v1/openapi.json" \
  --header "Authorization: Bearer $token" \
  --max-examples "$examples" \
  --seed "$seed" \
  --generation-database none \
  --request-timeout 40 \
  --workers 1 \
  --no-color) 2>&1 | tee "$tmp/fuzz.log"
rc=${PIPESTATUS[0]}
set -e
took=$(( $(date +%s) - start ))
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  # A request that never finished is the usual cause: the server logs
  # each request when it is answered, so its last lines say where it was.
  tail -n 20 "$tmp/server.log" >&2
  echo "fuzz-openapi: FAILED: schemathesis did not finish within ${budget} s (the server's last log lines above)" >&2
  exit 1
fi
if ! kill -0 "$pid" 2>/dev/null; then
  tail -n 50 "$tmp/server.log" >&2
  echo "fuzz-openapi: FAILED: the server died during the run (log above)" >&2
  exit 1
fi
# schemathesis sums up as "N generated, N passed, ..." or "N generated,
# F found U unique failures, ...": the closing line counts test cases.
count() { grep -oE "[0-9]+ $1" "$tmp/fuzz.log" | tail -n1 | grep -oE '^[0-9]+' || echo 0; }
generated=$(count generated)
found=$(count found)
failures=$(count "unique failures")
if [ "$rc" -ne 0 ]; then
  echo "fuzz-openapi: FAILED: schemathesis found failures (exit $rc, ${took} s); each above has a curl line to reproduce it" >&2
  echo "fuzz-openapi: $((generated - found)) passed, $(( failures > 0 ? failures : 1 )) failed"
  exit 1
fi
echo "fuzz-openapi: OK: every check passed against $base/v1/openapi.json in ${took} s (seed $seed)"
echo "fuzz-openapi: $generated passed, 0 failed"
