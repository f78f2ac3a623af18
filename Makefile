# Hora's entry points. `make demo` and `make test` do all the set-up a fresh machine needs
# (PyTorch 2.11.0 for libtorch, cached outside the checkout; see scripts/setup-libtorch.sh; and,
# for `make test`, the schemathesis API fuzzer, see scripts/setup-schemathesis.sh, and
# PostgreSQL for the PostgreSQL store's tests, scripts/setup-postgres.sh; and s3s-fs, the
# S3-compatible server the tests of blobs on S3 start, scripts/setup-s3.sh; and Debian's Chromium
# with the dashboard's npm packages for its browser tests, scripts/setup-dashboard.sh).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

# Puts libtorch where torch-sys finds it (and prints nothing else).
TORCH_ENV := eval "$$(scripts/setup-libtorch.sh --print-env)"
# Exports HORA_SCHEMATHESIS, the fuzzer the server's OpenAPI test runs.
FUZZ_ENV := eval "$$(scripts/setup-schemathesis.sh --print-env)"
# Exports HORA_FLOWER_PYTHON, the Flower the round-latency benchmark compares with.
FLOWER_ENV := eval "$$(scripts/setup-flower.sh --print-env)"
# Exports HORA_PACKAGE_ENV and HORA_PACKAGE_PYTHON: the environment (maturin, pytest, pyspark, peft; torch from
# the libtorch environment) the Python package is built into and tested from; installs Java.
PY_ENV := eval "$$(scripts/setup-python.sh --print-env)"
# Exports HORA_PG_BINDIR, where the PostgreSQL store's tests find initdb and postgres (installs
# Debian's postgresql when they are missing).
PG_ENV := eval "$$(scripts/setup-postgres.sh --print-env)"
# Exports HORA_S3_SERVER, the S3-compatible server (s3s-fs, from crates.io) the tests of blobs on
# S3 start.
S3_ENV := eval "$$(scripts/setup-s3.sh --print-env)"
# Exports HORA_NODE and HORA_CHROMIUM: what the dashboard's build check and browser tests run
# (installs Debian's chromium when missing, and dashboard/'s npm packages with `npm ci`).
DASH_ENV := eval "$$(scripts/setup-dashboard.sh --print-env)"
# Builds the Python package `hora` (python/) into that environment; $(1): extra maturin flags.
PY_INSTALL = (cd python && VIRTUAL_ENV="$$HORA_PACKAGE_ENV" "$$HORA_PACKAGE_PYTHON" -m maturin develop --quiet $(1))
NEXTEST_PROFILE ?= $(if $(CI),ci,default)

.PHONY: demo dashboard bench-dashboard replicas test bench bench-gpu bench-large bench-replicas bench-simulation bench-updates lint deps-check setup python dist dist-test dist-aarch64 dist-test-aarch64

## Release artefacts of this machine's architecture in dist/: the server's tarball, the client's
## tarball with its CPU libtorch beside it ($$ORIGIN), and an abi3 wheel (scripts/dist.sh).
dist:
	@scripts/dist.sh

## The artefacts unpacked and installed into a fresh directory without the build cache, and a
## federated round from each client artefact against the server's (scripts/dist-test.sh).
dist-test: dist
	@scripts/dist-test.sh

## The server's and the client's tarballs for 64-bit Arm (aarch64), cross-built with Debian's
## cross compilers and PyPI's aarch64 torch (scripts/setup-aarch64.sh installs them).
dist-aarch64:
	@scripts/dist.sh --target aarch64

## The aarch64 tarballs under qemu-user against this machine's: an emulated client trains rounds
## against an x86-64 server, an emulated server serves an x86-64 client.
dist-test-aarch64: dist dist-aarch64
	@scripts/dist-test.sh --target aarch64

## Set up libtorch, the API fuzzer, the Python environment, PostgreSQL, the S3 test server and
## cargo-deny (idempotent; seconds once installed).
setup:
	@scripts/setup-libtorch.sh
	@scripts/setup-schemathesis.sh
	@scripts/setup-python.sh
	@scripts/setup-postgres.sh
	@scripts/setup-s3.sh
	@scripts/setup-dashboard.sh
	@scripts/setup-cargo-deny.sh

## The federated Synthetic(1,1) benchmark with real processes: a server, 10 clients, 20 rounds
## of FedAvg and then of FedProx, a per-round table of each and the centralised baseline. Leaves
## nothing running.
demo:
	@$(TORCH_ENV); \
	cargo build --release -p hora-server -p hora-client --bins; \
	cargo build --release --example federated; \
	target/release/examples/federated $(if $(KEEP),--keep)

## The dashboard's costs (benches/dashboard.rs): a task page's first render in Chromium with
## 10,000 rounds of history against 10, and round latency and server CPU with 20 dashboards open
## against none.
bench-dashboard:
	@$(TORCH_ENV); $(DASH_ENV); cargo build --release -p hora-server --bins && \
	cargo bench -p hora --bench dashboard

## The dashboard's assets (dashboard/dist, committed and embedded in hora-server) rebuilt from
## dashboard/src with the npm packages of its lockfile.
dashboard:
	@$(DASH_ENV); cd dashboard && "$$HORA_NODE" build.mjs

## Three replicas on one PostgreSQL database (started for the run) and a shared blob directory,
## a federation across them, and the leader SIGKILLed after round 2: the failover, and the
## federation finishing on a standby. Leaves nothing running.
replicas:
	@$(TORCH_ENV); $(PG_ENV); \
	cargo build --release -p hora-server -p hora-client --bins; \
	cargo build --release --example replicas; \
	target/release/examples/replicas

## Every test (Rust, then the Python package's pytest suite), then the dependency policy. The
## binaries and examples are built first: the cross-process tests in tests/ and python/tests run them.
## hora-python's tests are the pytest suite (a Rust test binary of a Python extension has no
## interpreter to run in).
test:
	@$(TORCH_ENV); $(FUZZ_ENV); $(PY_ENV); $(PG_ENV); $(S3_ENV); $(DASH_ENV); \
	cargo build --workspace --bins --examples; \
	if cargo nextest --version >/dev/null 2>&1; then \
		cargo nextest run --workspace --exclude hora-python --all-targets --profile $(NEXTEST_PROFILE); \
	else \
		cargo test --workspace --exclude hora-python --all-targets; \
	fi; \
	$(call PY_INSTALL,); \
	"$$HORA_PACKAGE_PYTHON" -m pytest python/tests -q -p no:cacheprovider
	@scripts/check-deps.sh

## Installs the Python package `hora` (release build) into the cached environment and prints
## the interpreter that has it (for notebooks and scripts: `$$(make -s python) my_script.py`).
python:
	@$(TORCH_ENV); $(PY_ENV); $(call PY_INSTALL,--release) >&2; echo "$$HORA_PACKAGE_PYTHON"

## Benchmarks that print ratios against baselines measured in the same run.
bench:
	@$(TORCH_ENV); $(FLOWER_ENV); \
	cargo bench -p hora-client --bench training; \
	cargo build --release -p hora-server; \
	cargo bench -p hora-common --bench kernel; \
	cargo bench -p hora-common --bench envelope; \
	cargo bench -p hora-common --bench secagg; \
	cargo bench -p hora-server --bench ingest; \
	cargo bench -p hora-server --bench history; \
	cargo bench -p hora-server --bench dp_noise; \
	$(PG_ENV); cargo bench -p hora-server --bench fence; \
	cargo bench -p hora --bench server_memory; \
	cargo bench -p hora --bench hostile; \
	$(DASH_ENV); cargo bench -p hora --bench dashboard; \
	cargo build --release -p hora-client --bins; \
	cargo bench -p hora --bench round_latency; \
	cargo bench -p hora --bench compression; \
	scripts/dist.sh; cargo bench -p hora --bench footprint; \
	cargo build --release --example asynchronous; \
	target/release/examples/asynchronous; \
	cargo build --release --example collective; \
	cargo bench -p hora --bench allreduce; \
	cargo bench -p hora --bench elastic; \
	$(PY_ENV); $(call PY_INSTALL,--release); \
	"$$HORA_PACKAGE_PYTHON" python/bench/bench.py; \
	"$$HORA_PACKAGE_PYTHON" python/bench/fusion.py

## The GPU figures of the sync mode (needs a CUDA device; without one each part says so and
## measures nothing): the averaging kernel's fold against a device-to-device copy, hora.sync
## through NCCL against torch.distributed's NCCL, and the ring from CUDA tensors through pinned
## host memory against Gloo. Not part of `make bench`, which runs where there is no GPU.
bench-gpu:
	@$(TORCH_ENV); $(PY_ENV); cargo bench -p hora-common-tch --bench cuda_fold && \
	$(call PY_INSTALL,--release) && "$$HORA_PACKAGE_PYTHON" python/bench/gpu.py

## Replicas at scale (about ten minutes; not part of `make bench`): one round of 10,000 and of
## 20,000 clients (generator processes, a connection each) on one replica and on three (on a
## PostgreSQL server started for the run), then the failover after the leader's SIGKILL and
## each replica's ingest rate.
bench-replicas:
	@$(TORCH_ENV); $(PG_ENV); cargo build --release -p hora-server --bins && \
	cargo bench -p hora --bench replicas

## Simulation (benches/simulation.rs; minutes, not part of `make bench`): `hora-server simulate`
## and `hora.simulation.run` with a Python train_fn (the release package is installed first)
## against Flower's Simulation Runtime on Ray, same task and seeds (Synthetic(1,1), logistic
## regression, 1,000 clients, 100 a round, 10 rounds): wall time, peak PSS summed over each
## run's processes, final accuracy; then 100,000 clients against raw training throughput.
bench-simulation:
	@$(TORCH_ENV); $(FLOWER_ENV); $(PY_ENV); cargo build --release -p hora-server -p hora-client --bins && \
	$(call PY_INSTALL,--release) && cargo bench -p hora --bench simulation

## One round of a model past 2 GiB (HORA_LARGE_MODEL_MB, 2200) with 4 clients: transfer
## rates against the loopback TLS limit, peak RSS, cut and resumed transfers. Needs about
## 16 GB of memory and 5 x the model of disk, so it is not part of `make bench`.
bench-large:
	@$(TORCH_ENV); cargo build --release -p hora-server --bins && \
	cargo bench -p hora --bench large_model

## Compressed updates and models of any size in one run: the compression bench (bytes on the
## wire and accuracy after 20 rounds per codec, on the demo and the MNIST-format MLP), then
## bench-large's round of a model past 2 GiB. Needs what bench-large needs.
bench-updates:
	@$(TORCH_ENV); cargo build --release -p hora-server -p hora-client --bins && \
	cargo bench -p hora --bench compression && \
	cargo bench -p hora --bench large_model

## Formatting and clippy, warnings as errors.
lint:
	cargo fmt --all -- --check
	@$(TORCH_ENV); cargo clippy --workspace --all-targets -- -D warnings

## The dependency policy: cargo-deny (deny.toml) and the libtorch checks (scripts/check-deps.sh).
deps-check:
	@scripts/check-deps.sh
