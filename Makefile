# Hora's entry points. `make demo` and `make test` do all the set-up a fresh machine needs
# (PyTorch 2.11.0 for libtorch, cached outside the checkout; see scripts/setup-libtorch.sh; and,
# for `make test`, the schemathesis API fuzzer, see scripts/setup-schemathesis.sh).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

# Puts libtorch where torch-sys finds it (and prints nothing else).
TORCH_ENV := eval "$$(scripts/setup-libtorch.sh --print-env)"
# Exports HORA_SCHEMATHESIS, the fuzzer the server's OpenAPI test runs.
FUZZ_ENV := eval "$$(scripts/setup-schemathesis.sh --print-env)"
# Exports HORA_FLOWER_PYTHON, the Flower the round-latency benchmark compares with.
FLOWER_ENV := eval "$$(scripts/setup-flower.sh --print-env)"
NEXTEST_PROFILE ?= $(if $(CI),ci,default)

.PHONY: demo test bench lint deps-check setup

## Set up libtorch and the API fuzzer (idempotent; seconds once installed).
setup:
	@scripts/setup-libtorch.sh
	@scripts/setup-schemathesis.sh

## The federated Synthetic(1,1) benchmark with real processes: a server, 10 clients, 20 rounds,
## a per-round table and the centralised baseline. Leaves nothing running.
demo:
	@$(TORCH_ENV); \
	cargo build --release -p hora-server -p hora-client --bins; \
	cargo build --release --example federated; \
	target/release/examples/federated

## Every test, then the dependency policy. The binaries and examples are built first: the
## cross-process tests in tests/ run them.
test:
	@$(TORCH_ENV); $(FUZZ_ENV); \
	cargo build --workspace --bins --examples; \
	if cargo nextest --version >/dev/null 2>&1; then \
		cargo nextest run --workspace --all-targets --profile $(NEXTEST_PROFILE); \
	else \
		cargo test --workspace --all-targets; \
	fi
	@scripts/check-deps.sh

## Benchmarks that print ratios against baselines measured in the same run.
bench:
	@$(TORCH_ENV); $(FLOWER_ENV); \
	cargo bench -p hora-client --bench training; \
	cargo build --release -p hora-server; \
	cargo bench -p hora-common --bench kernel; \
	cargo bench -p hora-common --bench envelope; \
	cargo bench -p hora-common --bench secagg; \
	cargo bench -p hora-server --bench ingest; \
	cargo bench -p hora --bench server_memory; \
	cargo bench -p hora --bench hostile; \
	cargo build --release -p hora-client --bins; \
	cargo bench -p hora --bench round_latency; \
	cargo build --release --example asynchronous; \
	target/release/examples/asynchronous; \
	cargo build --release --example collective; \
	cargo bench -p hora --bench allreduce

## Formatting and clippy, warnings as errors.
lint:
	cargo fmt --all -- --check
	@$(TORCH_ENV); cargo clippy --workspace --all-targets -- -D warnings

deps-check:
	@scripts/check-deps.sh
