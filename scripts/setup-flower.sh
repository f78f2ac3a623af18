#!/usr/bin/env bash
# Installs Flower (flwr with its `simulation` extra, which brings Ray: the baseline of the
# round-latency and simulation benchmarks) into a virtual environment cached outside the
# checkout, and prints the Python interpreter that runs it.
#
# torch is not downloaded again: the environment sees the PyTorch of scripts/setup-libtorch.sh
# (run first, if needed) through a .pth file naming that environment's site-packages.
#
# Idempotent: when the cached environment already holds this version it returns in seconds.
# Usage: scripts/setup-flower.sh [--print-env]
#   --print-env  print the `export HORA_FLOWER_PYTHON=…` line the benchmark reads
set -euo pipefail

# 1.42.0 asks for a certifi release newer than the package index had when this was pinned.
FLWR_VERSION=1.41.0
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/venv-lib.sh
. "$here/venv-lib.sh"
venv="$cache_root/flower-$FLWR_VERSION"
python="$venv/bin/python"
stamp="$venv/.hora-flower-ok"

log() { echo "setup-flower: $*" >&2; }

torch_python="$(libtorch_python)"

usable() {
    [ -x "$python" ] && "$python" -c '
import importlib.metadata as m, sys, torch, flwr, ray
from flwr.simulation import run_simulation
from flwr.server import ServerApp
from flwr.client import ClientApp
sys.exit(m.version("flwr") != sys.argv[1])' "$FLWR_VERSION" 2>/dev/null
}

if [ ! -f "$stamp" ] || ! usable; then
    log "installing flwr[simulation]==$FLWR_VERSION into $venv (about 300 MB with Ray, a minute, once; torch comes from the libtorch environment)"
    rm -f "$stamp"
    venv_seeing "$venv" "$torch_python"
    "$python" -m pip install --quiet --disable-pip-version-check "flwr[simulation]==$FLWR_VERSION"
    usable || { log "flwr or torch is not importable after the install"; exit 1; }
    touch "$stamp"
    log "done"
fi

if [ "${1:-}" = "--print-env" ]; then
    echo "export HORA_FLOWER_PYTHON=$(printf %q "$python")"
fi
