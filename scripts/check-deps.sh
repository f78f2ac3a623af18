#!/usr/bin/env bash
# The dependency policy, checked against Cargo.lock's resolution:
# - no OpenSSL and no aws-lc anywhere (rustls with ring is our TLS; ring is our crypto);
# - tch is exactly 0.24.0 (it pairs with PyTorch 2.11.0);
# - neither the server nor the Python package links libtorch.
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
all=$(cargo tree --workspace --all-features --target all -e normal,build --prefix none --no-dedupe 2>/dev/null | awk '{print $1" "$2}' | sort -u)
for banned in openssl-sys openssl aws-lc-sys aws-lc-rs native-tls; do
    if grep -q "^$banned " <<<"$all"; then
        echo "check-deps: $banned is in the dependency tree: remove it (cargo tree -i $banned shows who pulls it in)"
        fail=1
    fi
done
tch=$(grep '^tch ' <<<"$all" | awk '{print $2}' | sort -u)
if [ "$tch" != "v0.24.0" ]; then
    echo "check-deps: tch must be v0.24.0 (pairs with PyTorch 2.11.0), found: ${tch:-none}"
    fail=1
fi
if cargo tree -p hora-server -e normal,build --prefix none 2>/dev/null | grep -qE '^(tch|torch-sys) '; then
    echo "check-deps: hora-server depends on libtorch (tch/torch-sys): the server must not link it"
    fail=1
fi
if cargo tree -p hora-python -e normal,build --prefix none 2>/dev/null | grep -qE '^(tch|torch-sys) '; then
    echo "check-deps: hora-python depends on libtorch (tch/torch-sys): the Python package must use the user's torch, not load a second libtorch"
    fail=1
fi
[ "$fail" = 0 ] && echo "check-deps: ok (no openssl, no aws-lc; tch $tch; hora-server and hora-python free of libtorch)"
exit "$fail"
