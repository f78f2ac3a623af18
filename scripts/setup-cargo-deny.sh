#!/usr/bin/env bash
# Installs cargo-deny (the dependency policy's checker, deny.toml) from crates.io into the cache
# outside the checkout, and prints the environment that puts it on PATH.
#
# Idempotent: seconds once installed (the first install compiles it, a few minutes).
# Usage: scripts/setup-cargo-deny.sh [--print-env]
set -euo pipefail

VERSION=0.20.2
cache_root="${HORA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hora}"
root="$cache_root/cargo-deny-$VERSION"

if ! "$root/bin/cargo-deny" --version 2>/dev/null | grep -qx "cargo-deny $VERSION"; then
    echo "setup-cargo-deny: installing cargo-deny $VERSION into $root (a few minutes, once)" >&2
    cargo install --quiet --locked --version "$VERSION" --root "$root" cargo-deny >&2
fi
if [ "${1:-}" = "--print-env" ]; then
    printf 'export PATH=%q:"$PATH"\n' "$root/bin"
fi
