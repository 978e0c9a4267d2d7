# The two commands a newcomer needs: `make demo` and `make test`.
# Both install R and everything else that is missing first (scripts/setup.sh).

CARGO ?= cargo

.PHONY: setup build demo test test-rootless lint bench kernel-testbed

setup:
	@./scripts/setup.sh

build: setup
	$(CARGO) build --release --workspace

# Runs examples/demo.R in a fresh embedded R worker: output, a warning, a
# plot. Installs R only, and builds only the command and the worker, in the
# `demo` profile (fast to build, as fast to run for the demo; Cargo.toml),
# without the Jupyter kernel (its libzmq is compiled from source).
demo:
	@./scripts/setup.sh --demo
	$(CARGO) build --profile demo -p rvisor-cli -p rvisor-worker --no-default-features
	./target/demo/rvisor run examples/demo.R --plots-dir demo-plots

# Every test: unit tests, the tests against real R (one process per test
# under nextest), the doc examples, the HTTP contract fuzzed against a
# live server (schemathesis on its own /v1/openapi.json, bounded), and a
# client generated from that document (openapi-python-client) run against
# a live server with a token, and a notebook with the rvisor kernel in
# JupyterLab, in Chromium (Playwright; about 20 s), and the web console
# in Chromium against a live server (tests/console; about 15 s).
test: setup
	$(CARGO) build --workspace
	RVISOR_WORKER=$(CURDIR)/target/debug/rvisor-worker $(CARGO) test --workspace --doc
	$(CARGO) nextest run --workspace --no-fail-fast
	./scripts/fuzz-openapi.sh
	./scripts/generated-client.sh
	./scripts/jupyterlab-tests.sh target/debug/rvisor
	./scripts/console-tests.sh target/debug/rvisor

# The confinement attack suite and the functional suites again as an
# ordinary user, i.e. with rootless confinement (docs/confinement.md,
# "Rootless"). Needs root: creates $(ROOTLESS_USER) when missing, builds
# here, then runs the already built test binaries as that user with
# nextest (reusing this build: binaries and cargo metadata are written to
# target/, and cargo-nextest is copied where the user can run it). The
# workspace and target/ must be readable by the user; target/tmp (the
# tests' CARGO_TARGET_TMPDIR) is made writable like /tmp. The list is of
# the whole workspace, as `make test` built it: listing one package
# resolves its dependencies' features apart and builds them all again
# (gigabytes more of target/; a CI machine's disk ran out linking them).
ROOTLESS_USER ?= rvtest
ROOTLESS_TESTS ?= package(rvisor-ffi-tests) & (binary(confinement) | binary(rootless) | binary(sessions) | binary(zygote))
test-rootless: setup
	@test "$$(id -u)" = 0 || { echo "test-rootless: run as root (it runs the tests as $(ROOTLESS_USER))" >&2; exit 1; }
	id -u $(ROOTLESS_USER) >/dev/null 2>&1 || useradd --create-home --shell /usr/sbin/nologin $(ROOTLESS_USER)
	$(CARGO) build --workspace
	$(CARGO) nextest list --workspace --list-type binaries-only --message-format json > target/nextest-binaries.json
	$(CARGO) metadata --format-version 1 --all-features --no-deps > target/nextest-cargo-metadata.json
	mkdir -p target/tmp target/rootless-bin
	chmod 1777 target/tmp
	install -m 755 "$$(command -v cargo-nextest)" target/rootless-bin/cargo-nextest
	chmod a+r target/nextest-binaries.json target/nextest-cargo-metadata.json
	@runuser -u $(ROOTLESS_USER) -- test -r Cargo.toml -a -x target/debug/rvisor-worker || { echo "test-rootless: $(ROOTLESS_USER) cannot read $(CURDIR) or its target/ (chmod o+rX them)" >&2; exit 1; }
	runuser -u $(ROOTLESS_USER) -- env -i HOME=$$(getent passwd $(ROOTLESS_USER) | cut -d: -f6) PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
		RVISOR_WORKER=$(CURDIR)/target/debug/rvisor-worker \
		target/rootless-bin/cargo-nextest nextest run --no-fail-fast \
		--binaries-metadata target/nextest-binaries.json --cargo-metadata target/nextest-cargo-metadata.json \
		-E '$(ROOTLESS_TESTS)'

# The Jupyter conformance suite runtimed/kernel-testbed (every tier) against
# `rvisor kernel`: not in `test`, since its first build (tokio, its own
# ZeroMQ) takes about 6 minutes here and it fetches from GitHub
# (scripts/kernel-testbed.sh; docs/jupyter.md, "Conformance").
kernel-testbed: setup
	$(CARGO) build -p rvisor-cli -p rvisor-worker
	./scripts/kernel-testbed.sh target/debug/rvisor

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	python3 scripts/check-cycles.py --self-test
	python3 scripts/check-cycles.py

# The benchmark: rvisor vs Rscript, callr and Rserve, interleaved, one run.
# Installs the peers (r-cran-callr, r-cran-rserve, r-cran-rsclient) if missing.
bench: build
	./target/release/rvisor bench --quick
