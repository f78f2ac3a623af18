#!/usr/bin/env bash
# Sets up what the Python package's build and tests need, cached outside the checkout:
# a virtual environment with maturin, pytest, pyspark, peft (for the LoRA test; with the
# transformers and accelerate it needs) and what hora.simulation uses (pandas, pyarrow,
# cloudpickle, matplotlib, tqdm) (torch and numpy come from the
# libtorch environment of scripts/setup-libtorch.sh through a .pth file, not a second
# download), and a Java runtime for Spark (Debian's openjdk-17-jre-headless, installed with
# apt-get when `java` is missing).
#
# Idempotent: when the cached environment already holds these versions it returns in seconds.
# Usage: scripts/setup-python.sh [--print-env]
#   --print-env  print `export VAR=value` lines: HORA_PACKAGE_ENV (the environment, for
#                `maturin develop`) and HORA_PACKAGE_PYTHON (its interpreter, for pytest)
set -euo pipefail

MATURIN_VERSION=1.16.0
PYTEST_VERSION=9.2.0
PYSPARK_VERSION=4.3.0
PEFT_VERSION=0.21.2
TRANSFORMERS_VERSION=5.24.0
ACCELERATE_VERSION=1.15.0
# hora.simulation: results as DataFrames, Arrow/Parquet data, the training function shipped to
# worker processes by value, plots and progress bars.
# (pandas 2: PySpark 4.3 warns that it does not fully support pandas 3.)
PANDAS_VERSION=2.3.3
PYARROW_VERSION=26.0.1
CLOUDPICKLE_VERSION=3.1.3
MATPLOTLIB_VERSION=3.11.2
TQDM_VERSION=4.70.1
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/venv-lib.sh
. "$here/venv-lib.sh"
venv="$cache_root/python-env"
python="$venv/bin/python"
stamp="$venv/.hora-python-ok"
want="maturin==$MATURIN_VERSION pytest==$PYTEST_VERSION pyspark==$PYSPARK_VERSION"
# Installed after, without --ignore-installed: what they need of torch is the libtorch one.
want_over="peft==$PEFT_VERSION transformers==$TRANSFORMERS_VERSION accelerate==$ACCELERATE_VERSION
pandas==$PANDAS_VERSION pyarrow==$PYARROW_VERSION cloudpickle==$CLOUDPICKLE_VERSION
matplotlib==$MATPLOTLIB_VERSION tqdm==$TQDM_VERSION"
want_over="$(echo $want_over)"

log() { echo "setup-python: $*" >&2; }

torch_python="$(libtorch_python)"

if ! command -v java >/dev/null 2>&1; then
    log "installing a Java runtime for Spark (openjdk-17-jre-headless, from Debian's packages)"
    if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends openjdk-17-jre-headless >&2
    command -v java >/dev/null 2>&1 || { log "java is still missing after the install"; exit 1; }
fi

usable() {
    [ -x "$python" ] && [ -x "$venv/bin/maturin" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want $want_over" ] && "$python" -c '
import numpy, torch, pytest, pyspark, maturin, peft, pandas, pyarrow, cloudpickle, matplotlib, tqdm' 2>/dev/null
}

if ! usable; then
    log "installing $want $want_over into $venv (about 550 MB, a minute, once; torch comes from the libtorch environment)"
    rm -f "$stamp"
    venv_seeing "$venv" "$torch_python"
    # Into this environment even where the libtorch one has them too (maturin's binary must be here).
    # shellcheck disable=SC2086
    "$python" -m pip install --quiet --disable-pip-version-check --ignore-installed $want
    # The torch and numpy the environment sees are the libtorch environment's: pinned, so that
    # a package wanting others fails here instead of installing a second torch over them.
    "$python" -c 'from importlib.metadata import version as v; print("torch==" + v("torch")); print("numpy==" + v("numpy"))' >"$venv/constraints.txt"
    # shellcheck disable=SC2086
    "$python" -m pip install --quiet --disable-pip-version-check --constraint "$venv/constraints.txt" $want_over
    "$python" -c 'import numpy, torch, pytest, pyspark, maturin, peft, pandas, pyarrow, cloudpickle, matplotlib, tqdm' || { log "the environment is not usable after the install"; exit 1; }
    echo "$want $want_over" >"$stamp"
    log "done"
fi

if [ "${1:-}" = "--print-env" ]; then
    echo "export HORA_PACKAGE_ENV=$(printf %q "$venv")"
    echo "export HORA_PACKAGE_PYTHON=$(printf %q "$python")"
fi
