#!/usr/bin/env bash
# What the dashboard's build and browser tests need (tests/dashboard.rs): Node.js 18 or later
# with npm (Debian's `nodejs` and `npm` when missing), the npm packages of dashboard/package-lock.json (esbuild, uPlot, playwright-core)
# installed into dashboard/node_modules with `npm ci`, and Debian's Chromium, which
# playwright-core drives (`npx playwright install` is not used: it downloads a browser from
# elsewhere). Installs what is missing with apt-get (sudo when not root).
#
# Idempotent: seconds once installed (npm ci runs again only when the lockfile changed).
# Usage: scripts/setup-dashboard.sh [--print-env]
#   --print-env  print `export HORA_NODE=… HORA_CHROMIUM=…`
set -euo pipefail

log() { echo "setup-dashboard: $*" >&2; }
root="$(cd "$(dirname "$0")/.." && pwd)"
dashboard="$root/dashboard"

if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
apt_install() {
    $sudo apt-get update -qq >&2
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    log "installing Node.js and npm for the dashboard's build check and browser tests (nodejs, npm, from Debian's packages)"
    apt_install nodejs npm
fi
node="$(command -v node)"
major="$("$node" -p 'process.versions.node.split(".")[0]')"
if [ "$major" -lt 18 ]; then
    log "Node.js $("$node" --version) is too old for playwright-core and esbuild: install Node.js 18 or later and run again"
    exit 1
fi

find_chromium() {
    local c
    for c in "${HORA_CHROMIUM:-}" /usr/bin/chromium /usr/bin/chromium-browser; do
        if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
    done
    return 1
}
if ! chromium="$(find_chromium)"; then
    log "installing Chromium for the dashboard's browser tests (chromium, from Debian's packages)"
    apt_install chromium
    chromium="$(find_chromium)" || { log "chromium is still missing after the install (on Ubuntu, whose chromium is a snap, set HORA_CHROMIUM to a Chromium or Chrome binary)"; exit 1; }
fi

# npm ci again only when the lockfile is not the one installed.
stamp="$dashboard/node_modules/.hora-lock"
want="$(sha256sum "$dashboard/package-lock.json" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    log "installing the dashboard's npm packages (npm ci)"
    (cd "$dashboard" && npm ci --no-audit --no-fund --loglevel=error >&2)
    echo "$want" > "$stamp"
fi

if [ "${1:-}" = "--print-env" ]; then
    echo "export HORA_NODE=$(printf %q "$node") HORA_CHROMIUM=$(printf %q "$chromium")"
fi
