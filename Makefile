# The two commands a newcomer needs: `make demo` and `make test`.
# Both install R and everything else that is missing first (scripts/setup.sh).

CARGO ?= cargo

.PHONY: setup build demo test lint bench

setup:
	@./scripts/setup.sh

build: setup
	$(CARGO) build --release --workspace

# Runs examples/demo.R in a fresh embedded R worker: output, a warning, a plot.
demo: build
	./target/release/rvisor run examples/demo.R --plots-dir demo-plots

# Every test: unit tests, the tests against real R (one process per test
# under nextest), the doc examples, and the HTTP contract fuzzed against a
# live server (schemathesis on its own /v1/openapi.json, bounded).
test: setup
	$(CARGO) build --workspace
	RVISOR_WORKER=$(CURDIR)/target/debug/rvisor-worker $(CARGO) test --workspace --doc
	$(CARGO) nextest run --workspace --no-fail-fast
	./scripts/fuzz-openapi.sh

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# The benchmark: rvisor vs Rscript, callr and Rserve, interleaved, one run.
# Installs the peers (r-cran-callr, r-cran-rserve, r-cran-rsclient) if missing.
bench: build
	./target/release/rvisor bench --quick
