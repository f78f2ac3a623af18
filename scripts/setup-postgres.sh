#!/usr/bin/env bash
# Makes sure PostgreSQL's server programs (initdb, postgres) are installed: the PostgreSQL store's
# tests start throwaway servers of their own with them (server/src/store/postgres/test_server.rs).
# Installs Debian's `postgresql` with apt-get when they are missing (sudo when not root). Nothing
# is configured or started here; Debian's package may create and start its own `main` cluster,
# which the tests do not use.
#
# Idempotent: returns at once when the programs are there.
# Usage: scripts/setup-postgres.sh [--print-env]
#   --print-env  print `export HORA_PG_BINDIR=…`: the directory holding them, where the tests
#                look first
set -euo pipefail

log() { echo "setup-postgres: $*" >&2; }

# Prints the first directory holding initdb and postgres, as the tests look for it.
bindir() {
    local dir candidates=()
    [ -n "${HORA_PG_BINDIR:-}" ] && candidates+=("$HORA_PG_BINDIR")
    if command -v pg_config >/dev/null 2>&1; then candidates+=("$(pg_config --bindir)"); fi
    if command -v initdb >/dev/null 2>&1; then
        candidates+=("$(dirname "$(readlink -f "$(command -v initdb)")")")
    fi
    if [ -d /usr/lib/postgresql ]; then
        while read -r dir; do candidates+=("/usr/lib/postgresql/$dir/bin"); done \
            < <(ls /usr/lib/postgresql | sort -rn)
    fi
    for dir in "${candidates[@]}"; do
        if [ -x "$dir/initdb" ] && [ -x "$dir/postgres" ]; then
            echo "$dir"
            return 0
        fi
    done
    return 1
}

if ! dir="$(bindir)"; then
    log "installing PostgreSQL for the PostgreSQL store's tests (postgresql, from Debian's packages)"
    if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends postgresql >&2
    dir="$(bindir)" || { log "initdb and postgres are still missing after the install"; exit 1; }
fi

if [ "${1:-}" = "--print-env" ]; then
    echo "export HORA_PG_BINDIR=$(printf %q "$dir")"
fi
