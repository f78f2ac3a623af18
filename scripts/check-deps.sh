#!/usr/bin/env bash
# The dependency policy, checked against Cargo.lock's resolution:
# - cargo-deny (deny.toml): no OpenSSL and no aws-lc anywhere (rustls with ring is our TLS; ring
#   is our crypto), only the licenses deny.toml allows, crates only from crates.io;
# - tch is exactly 0.24.0 (it pairs with PyTorch 2.11.0);
# - neither the server nor the Python package links libtorch (cargo-deny's bans name the crates
#   allowed to depend on a crate directly, not what a package reaches through them).
set -euo pipefail
cd "$(dirname "$0")/.."
deny_env="$(scripts/setup-cargo-deny.sh --print-env)" \
    || { echo "check-deps: installing cargo-deny failed (see above)"; exit 1; }
eval "$deny_env"
fail=0
if ! cargo deny --log-level error check bans licenses sources; then
    echo "check-deps: cargo deny found a dependency outside the policy (deny.toml): see above"
    fail=1
fi
all=$(cargo tree --workspace --all-features --target all -e normal,build --prefix none --no-dedupe 2>/dev/null | awk '{print $1" "$2}' | sort -u)
tch=$(grep '^tch ' <<<"$all" | awk '{print $2}' | sort -u)
if [ "$tch" != "v0.24.0" ]; then
    echo "check-deps: tch must be v0.24.0 (pairs with PyTorch 2.11.0), found: ${tch:-none}"
    fail=1
fi
# (cargo tree's output kept first: a failing cargo tree stops the script instead of passing.)
server_tree=$(cargo tree -p hora-server -e normal,build --prefix none)
python_tree=$(cargo tree -p hora-python -e normal,build --prefix none)
if grep -qE '^(tch|torch-sys) ' <<<"$server_tree"; then
    echo "check-deps: hora-server depends on libtorch (tch/torch-sys): the server must not link it"
    fail=1
fi
if grep -qE '^(tch|torch-sys) ' <<<"$python_tree"; then
    echo "check-deps: hora-python depends on libtorch (tch/torch-sys): the Python package must use the user's torch, not load a second libtorch"
    fail=1
fi
[ "$fail" = 0 ] && echo "check-deps: ok (cargo deny: bans, licenses, sources; tch $tch; hora-server and hora-python free of libtorch)"
exit "$fail"
