#!/usr/bin/env bash
# The rvisor kernel in a real browser: JupyterLab (PyPI) on loopback,
# driven by Playwright (npm) with Debian's Chromium (tests/jupyterlab/).
#
#   scripts/jupyterlab-tests.sh [RVISOR_BIN]    (default target/debug/rvisor)
#
# Installs JupyterLab with pip and Playwright's test runner with npm when
# missing (no browser is downloaded: CHROMIUM, default /usr/bin/chromium).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export RVISOR_BIN=$(realpath "${1:-$root/target/debug/rvisor}")
command -v "${CHROMIUM:-/usr/bin/chromium}" >/dev/null || {
  echo "jupyterlab-tests.sh: no Chromium (Debian: apt-get install chromium)" >&2; exit 2; }
python3 -c "import jupyterlab" 2>/dev/null || python3 -m pip install --quiet "jupyterlab==4.6.6"
cd "$root/tests/jupyterlab"
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1
[ -d node_modules/@playwright/test ] || { if [ -f package-lock.json ]; then npm ci --silent; else npm install --silent; fi; }
npx playwright test
