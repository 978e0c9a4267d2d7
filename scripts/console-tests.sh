#!/usr/bin/env bash
# The web console (/ui/) in a real browser: a real `rvisor serve` on
# loopback with two tenants' tokens and an operator's, driven by
# Playwright (npm) with Debian's Chromium (tests/console/).
#
#   scripts/console-tests.sh [RVISOR_BIN]    (default target/debug/rvisor)
#
# Installs Playwright's test runner with npm when missing (`npm ci` from
# the committed lock file; no browser is downloaded: CHROMIUM, default
# /usr/bin/chromium). Screenshots of each page: target/console-artifacts/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export RVISOR_BIN=$(realpath "${1:-$root/target/debug/rvisor}")
command -v "${CHROMIUM:-/usr/bin/chromium}" >/dev/null || {
  echo "console-tests.sh: no Chromium (Debian: apt-get install chromium)" >&2; exit 2; }
cd "$root/tests/console"
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1
[ -d node_modules/@playwright/test ] || npm ci --silent
npx playwright test
