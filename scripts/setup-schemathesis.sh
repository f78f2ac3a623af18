#!/usr/bin/env bash
# Installs schemathesis (the property-based API fuzzer the server's OpenAPI test runs) into a
# virtual environment cached outside the checkout, and prints where its executable is.
#
# Idempotent: when the cached environment already holds this version it returns in seconds.
# Usage: scripts/setup-schemathesis.sh [--print-env]
#   --print-env  print the `export HORA_SCHEMATHESIS=…` line the tests read (used by the Makefile)
set -euo pipefail

SCHEMATHESIS_VERSION=4.32.5
cache_root="${HORA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hora}"
venv="$cache_root/schemathesis-$SCHEMATHESIS_VERSION"
python="$venv/bin/python"
st="$venv/bin/schemathesis"
stamp="$venv/.hora-schemathesis-ok"

log() { echo "setup-schemathesis: $*" >&2; }

installed_version() {
    [ -x "$python" ] && "$python" -c 'import importlib.metadata as m, sys; sys.stdout.write(m.version("schemathesis"))' 2>/dev/null
}

if [ ! -f "$stamp" ] || [ "$(installed_version || true)" != "$SCHEMATHESIS_VERSION" ]; then
    log "installing schemathesis==$SCHEMATHESIS_VERSION into $venv (about 100 MB, a minute, once)"
    mkdir -p "$cache_root"
    base_python="${HORA_PYTHON:-$(command -v python3 || true)}"
    [ -n "$base_python" ] || { log "python3 not found: install Python 3.10+ first"; exit 1; }
    rm -f "$stamp"
    [ -x "$python" ] || "$base_python" -m venv "$venv"
    "$python" -m pip install --quiet --disable-pip-version-check "schemathesis==$SCHEMATHESIS_VERSION"
    [ "$(installed_version)" = "$SCHEMATHESIS_VERSION" ] && [ -x "$st" ] \
        || { log "schemathesis is not usable after the install"; exit 1; }
    touch "$stamp"
    log "done"
fi

if [ "${1:-}" = "--print-env" ]; then
    echo "export HORA_SCHEMATHESIS=$(printf %q "$st")"
fi
