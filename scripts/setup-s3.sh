#!/usr/bin/env bash
# Installs s3s-fs (a real S3-compatible server over a directory, from crates.io) under the cache
# directory, for the tests of blobs on S3 (`--blobs s3://…`), and prints where it is.
#
# Idempotent: when the cached binary is this version it returns at once. The first install
# compiles it (a few minutes, once).
# Usage: scripts/setup-s3.sh [--print-env]
#   --print-env  print the `export HORA_S3_SERVER=…` line the tests read (used by the Makefile)
set -euo pipefail

S3S_FS_VERSION=0.14.1
cache_root="${HORA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hora}"
root="$cache_root/s3s-fs-$S3S_FS_VERSION"
bin="$root/bin/s3s-fs"

log() { echo "setup-s3: $*" >&2; }

if [ ! -x "$bin" ]; then
    log "installing s3s-fs $S3S_FS_VERSION into $root (compiles it: a few minutes, once)"
    mkdir -p "$cache_root"
    # Its own target directory, removed after: nothing of it lands in the checkout.
    build="$(mktemp -d "$cache_root/.tmp-s3s-fs-build-XXXXXX")"
    trap 'rm -rf "$build"' EXIT
    CARGO_TARGET_DIR="$build" cargo install --quiet --locked --root "$root" \
        --version "$S3S_FS_VERSION" --features binary s3s-fs
    [ -x "$bin" ] || { log "s3s-fs is not there after the install"; exit 1; }
    log "done"
fi

if [ "${1:-}" = "--print-env" ]; then
    echo "export HORA_S3_SERVER=$(printf %q "$bin")"
fi
