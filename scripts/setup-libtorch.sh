#!/usr/bin/env bash
# Installs PyTorch 2.11.0 (the libtorch that tch 0.24.0 is built against) into a virtual
# environment cached outside the checkout, and prints the environment the build needs.
#
# Idempotent: when the cached environment already holds torch 2.11.0 it returns in seconds.
# Usage: scripts/setup-libtorch.sh [--print-env]
#   --print-env  print `export VAR=value` lines for the build (used by the Makefile)
set -euo pipefail

TORCH_VERSION=2.11.0
cache_root="${HORA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hora}"
venv="$cache_root/torch-$TORCH_VERSION"
python="$venv/bin/python"
stamp="$venv/.hora-torch-ok"

log() { echo "setup-libtorch: $*" >&2; }

installed_version() {
    [ -x "$python" ] && "$python" -c 'import torch, sys; sys.stdout.write(torch.__version__.split("+")[0])' 2>/dev/null
}

if [ ! -f "$stamp" ] || [ "$(installed_version || true)" != "$TORCH_VERSION" ]; then
    log "installing torch==$TORCH_VERSION into $venv (about 4.6 GB, a few minutes, once)"
    mkdir -p "$cache_root"
    base_python="${HORA_PYTHON:-$(command -v python3)}"
    [ -n "$base_python" ] || { log "python3 not found: install Python 3.10+ first"; exit 1; }
    rm -f "$stamp"
    [ -x "$python" ] || "$base_python" -m venv "$venv"
    "$python" -m pip install --quiet --disable-pip-version-check "torch==$TORCH_VERSION" numpy
    [ "$(installed_version)" = "$TORCH_VERSION" ] || { log "torch import failed after install"; exit 1; }
    touch "$stamp"
    log "done"
fi

if [ "${1:-}" = "--print-env" ]; then
    torch_lib="$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
    # torch-sys finds libtorch through this interpreter (LIBTORCH_USE_PYTORCH=1).
    echo "export PATH=$venv/bin:\$PATH"
    echo "export LIBTORCH_USE_PYTORCH=1"
    echo "export HORA_TORCH_PYTHON=$python"
    echo "export HORA_LIBTORCH_LIB=$torch_lib"
fi
