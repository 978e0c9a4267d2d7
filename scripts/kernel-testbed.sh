#!/usr/bin/env bash
# Builds the Jupyter kernel conformance suite runtimed/kernel-testbed and runs
# every tier of it against `rvisor kernel` (docs/jupyter.md, "Conformance").
#
#   scripts/kernel-testbed.sh [RVISOR_BIN]     (default target/debug/rvisor)
#
# Sources, pinned to the revisions below: KERNEL_TESTBED_GIT and RUNTIMED_GIT
# name git directories that hold them (a mirror, a clone), else they are
# cloned from GitHub. The suite's git dependencies (jupyter-protocol,
# runtimelib of runtimed) are made path dependencies, so only crates.io is
# reached. Built in target/kernel-testbed (its own target dir); the report
# is target/kernel-testbed/report.{txt,json}. Exits 1 if a test fails.
set -euo pipefail

TESTBED_REV=49271186d08319747834a501acf5af100e18bcd0
RUNTIMED_REV=4de02f844509c2bf39d4ad7d8b70d838baa365bd  # kernel-testbed's Cargo.lock

root=$(cd "$(dirname "$0")/.." && pwd)
rvisor=$(realpath "${1:-$root/target/debug/rvisor}")
work=${KERNEL_TESTBED_DIR:-$root/target/kernel-testbed}
mkdir -p "$work"

# The git directory holding REV of github.com/$1, as $2 names or cloned.
source_git() {
  local repo=$1 given=$2 rev=$3 dir
  if [ -n "$given" ]; then dir=$given
  else
    dir=$work/git/${repo#*/}.git
    [ -d "$dir" ] || git clone --quiet --bare "https://github.com/$repo" "$dir"
  fi
  git --git-dir="$dir" cat-file -e "$rev^{commit}" 2>/dev/null || {
    echo "kernel-testbed.sh: $dir lacks commit $rev of $repo; fetch it" >&2; exit 2; }
  echo "$dir"
}

unpack() {  # git dir, rev, destination
  if [ ! -f "$3/.rev" ] || [ "$(cat "$3/.rev")" != "$2" ]; then
    rm -rf "$3"; mkdir -p "$3"
    git --git-dir="$1" archive "$2" | tar -x -C "$3"
    echo "$2" > "$3/.rev"
  fi
}

unpack "$(source_git runtimed/kernel-testbed "${KERNEL_TESTBED_GIT:-}" $TESTBED_REV)" \
  $TESTBED_REV "$work/kernel-testbed"
unpack "$(source_git runtimed/runtimed "${RUNTIMED_GIT:-}" $RUNTIMED_REV)" \
  $RUNTIMED_REV "$work/runtimed"

# Path dependencies instead of the git ones.
toml=$work/kernel-testbed/Cargo.toml
sed -i \
  -e "s|^jupyter-protocol = { git = [^,]*, branch = \"main\" }|jupyter-protocol = { path = \"$work/runtimed/crates/jupyter-protocol\" }|" \
  -e "s|^runtimelib = { git = [^,]*, branch = \"main\",|runtimelib = { path = \"$work/runtimed/crates/runtimelib\",|" \
  "$toml"
# Its own workspace (it may be unpacked under another one's target/).
grep -q '^\[workspace\]' "$toml" || printf '\n[workspace]\n' >> "$toml"
if grep -q 'git = ' "$toml"; then
  echo "kernel-testbed.sh: $toml still has git dependencies:" >&2; grep 'git = ' "$toml" >&2; exit 2
fi

echo "kernel-testbed.sh: building the suite (first time: a few minutes)" >&2
CARGO_TARGET_DIR=$work/target cargo build --quiet --manifest-path "$toml"
suite=$work/target/debug/jupyter-kernel-test

# The kernel from a private kernelspec.
prefix=$work/prefix
rm -rf "$prefix"
"$rvisor" kernel install --prefix "$prefix" --name rvisor-testbed -- --host-idle-secs 5 >/dev/null
export JUPYTER_PATH=$prefix/share/jupyter

status=0
"$suite" rvisor-testbed --format json --output "$work/report.json" || status=$?
"$suite" rvisor-testbed | tee "$work/report.txt" || status=$?
python3 - "$work/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
res = r.get("results", [])
def status(t):
    r = t.get("result", {})
    return str(r.get("status", r) if isinstance(r, dict) else r).lower()
bad = [t for t in res if "pass" not in status(t)]
# The suite counts a partial pass as a pass; say which, so it is not hidden.
partial = [t.get("name", "?") for t in res if "partial" in status(t)]
note = f" ({len(partial)} of them partial: {', '.join(partial)})" if partial else ""
print(f"kernel-testbed: {len(res) - len(bad)}/{len(res)} passed{note}", file=sys.stderr)
sys.exit(1 if bad else 0)
PY
exit $status
