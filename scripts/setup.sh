#!/usr/bin/env bash
# Installs what rvisor needs on a fresh Debian machine with Rust: R (with its
# headers and shared library), the R packages the tests use, and
# cargo-nextest if missing. Safe to run again: it installs only what is
# missing. Needs root (or sudo) for apt-get.
#
#   scripts/setup.sh          # everything `make test` needs
#   scripts/setup.sh --demo   # what `make demo` needs: R itself (libR and
#                             # its base packages), nothing for the tests
set -euo pipefail

mode=all
[ "${1:-}" = "--demo" ] && mode=demo

need=()
# Installs the Debian packages listed in need (none: nothing to do).
install_needed() {
  [ ${#need[@]} -gt 0 ] || return 0
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  echo "setup: installing ${need[*]}" >&2
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${need[@]}"
}

if [ "$mode" = demo ]; then
  # The demo runs base R only (lm, a base plot); rvisor links libR.so
  # from r-base-core and needs no headers to build.
  command -v R >/dev/null 2>&1 || need+=(r-base-core)
  install_needed
  exit 0
fi
command -v R >/dev/null 2>&1 || need+=(r-base-core r-base-dev)
[ -e /usr/share/R/include/R.h ] || [ -e "$(R RHOME 2>/dev/null)/include/R.h" ] || need+=(r-base-dev)
r_has() { command -v Rscript >/dev/null 2>&1 && Rscript -e "quit(status = !requireNamespace('$1', quietly = TRUE))" >/dev/null 2>&1; }
for pkg in ggplot2 jsonlite lintr; do
  r_has "$pkg" || need+=("r-cran-$pkg")
done
# R Markdown and the program it runs, for the allow-list of programs
# (ffi-tests/tests/confinement.rs renders a report in a confined worker
# with pandoc, the program rvisor allows by default when installed).
r_has rmarkdown || need+=(r-cran-rmarkdown)
r_has knitr || need+=(r-cran-knitr)
# readxl: ffi-tests/tests/files.rs uploads an .xlsx to a session and reads
# it with readxl (docs/files.md).
r_has readxl || need+=(r-cran-readxl)
command -v pandoc >/dev/null 2>&1 || need+=(pandoc)
# Rich results (docs/output-and-plots.md, "Displays"): repr renders tables
# as HTML and Markdown; htmlwidgets, DT, plotly and flextable are the
# HTML-only values the tests show; svglite for SVG plots on request;
# chromium opens a widget's HTML offline in ffi-tests/tests/displays.rs.
for pkg in repr htmlwidgets DT plotly svglite flextable; do
  r_has "$pkg" || need+=("r-cran-$(echo "$pkg" | tr 'A-Z' 'a-z')")
done
command -v chromium >/dev/null 2>&1 || need+=(chromium)
# npm: Playwright's test runner for the JupyterLab browser test
# (tests/jupyterlab, scripts/jupyterlab-tests.sh).
command -v npm >/dev/null 2>&1 || need+=(npm)
# R's recommended packages (MASS, lattice, Matrix, survival, ...), present in
# every standard R installation: ten Debian packages with
# --no-install-recommends.
r_has survival && r_has MASS && r_has boot || need+=(r-recommended)
# nginx: the router of the multi-node test (ffi-tests/tests/multinode.rs
# runs deploy/nginx/rvisor.conf in it). Debian puts it in /usr/sbin.
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx)
# valgrind: the instruction counts of the regression guard
# (scripts/perf-guard.sh, run by .ci/run).
command -v valgrind >/dev/null 2>&1 || need+=(valgrind)
# IRkernel: the peer of the Jupyter kernel's bench (scripts/bench-kernel.py).
# (The kernel's libzmq needs nothing from Debian: the zmq crate builds
# libzmq 4.3.4 from its own source with the C++ compiler R's headers need.)
r_has IRkernel || need+=(r-cran-irkernel)

install_needed

if ! cargo nextest --version >/dev/null 2>&1; then
  echo "setup: installing cargo-nextest" >&2
  cargo install cargo-nextest --locked
fi

# pynng: the nng client the end-to-end test of `rvisor serve --nng` uses
# (Debian 12 packages neither pynng nor R's nanonext).
if command -v python3 >/dev/null 2>&1 && ! python3 -c "import pynng" >/dev/null 2>&1; then
  echo "setup: installing pynng (Python nng client, for the nng tests)" >&2
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "pynng==0.9.0"
fi

# schemathesis: the OpenAPI fuzzer scripts/fuzz-openapi.sh runs against a
# live `rvisor serve` in `make test` (the server's own /v1/openapi.json,
# all checks).
if command -v python3 >/dev/null 2>&1 && ! python3 -m schemathesis.cli --version 2>/dev/null | grep -q "4.32.5"; then
  echo "setup: installing schemathesis (OpenAPI fuzzer, for the HTTP contract test)" >&2
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "schemathesis==4.32.5"
fi

# openapi-python-client: scripts/generated-client.sh (in `make test`)
# generates a Python client from a live server's /v1/openapi.json and runs
# it against the server.
if command -v python3 >/dev/null 2>&1 && ! python3 -m openapi_python_client --version 2>/dev/null | grep -q "0.29.1"; then
  echo "setup: installing openapi-python-client (client generator, for the generated-client test)" >&2
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "openapi-python-client==0.29.1"
fi

# moto's S3 server: the shared store of the multi-node test
# (`moto_server -H 127.0.0.1 -p PORT`; Debian 12 has no S3 server).
if command -v python3 >/dev/null 2>&1 && ! python3 -c "import moto, flask" >/dev/null 2>&1; then
  echo "setup: installing moto[server] (a local S3 server, for the multi-node test)" >&2
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "moto[server]==5.2.1"
fi

# jupyter_client, nbclient, nbformat: the Jupyter kernel's end-to-end tests
# (ffi-tests/tests/jupyter.rs drives tests/jupyter/check.py) and its bench;
# ipykernel registers nothing but gives `jupyter kernelspec` its Python kernel.
if command -v python3 >/dev/null 2>&1 && ! python3 -c "import jupyter_client, nbclient, nbformat, ipykernel" >/dev/null 2>&1; then
  echo "setup: installing jupyter_client, nbclient, nbformat, ipykernel (for the Jupyter kernel tests)" >&2
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    "jupyter_client==8.10.0" "nbclient==0.11.0" "nbformat==5.11.1" "ipykernel==7.4.0"
fi
# JupyterLab: the kernel in a real browser (scripts/jupyterlab-tests.sh).
if command -v python3 >/dev/null 2>&1 && ! python3 -c "import jupyterlab" >/dev/null 2>&1; then
  echo "setup: installing jupyterlab (for the JupyterLab browser test)" >&2
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "jupyterlab==4.6.6"
fi
# Playwright's test runner for the browser tests (tests/jupyterlab,
# tests/console), from their committed lock files; no browser download
# (they drive Debian's chromium).
for dir in tests/jupyterlab tests/console; do
  d="$(cd "$(dirname "$0")/.." && pwd)/$dir"
  if command -v npm >/dev/null 2>&1 && [ -f "$d/package-lock.json" ] && [ ! -d "$d/node_modules/@playwright/test" ]; then
    echo "setup: installing Playwright's test runner in $dir (npm ci)" >&2
    (cd "$d" && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --silent)
  fi
done
