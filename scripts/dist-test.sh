#!/usr/bin/env bash
# `make dist-test`: the artefacts of `make dist` (dist/) as a user without this machine's build
# cache gets them. Into a fresh directory, in a bare environment (no LD_LIBRARY_PATH, another
# HOME): the server's tarball serves, the client's tarball makes the initial weights and trains
# round 1, and the wheel, installed into a fresh virtual environment, trains round 2 from Python.
# The published rounds must carry the two clients' updates.
#
# `scripts/dist-test.sh --target aarch64` (`make dist-test-aarch64`): the aarch64 tarballs of
# `make dist-aarch64` under qemu-user, against this machine's own: an emulated aarch64 client
# trains two rounds against the x86-64 server, then an emulated aarch64 server serves an x86-64
# client two rounds. Prints the figures the README quotes.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "dist-test: $*" >&2; }
fail() { log "FAILED: $*"; exit 1; }
ms_since() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }

cross=""
case "${1:-}" in
    "") ;;
    --target)
        [ "${2:-}" = aarch64 ] || fail "--target takes aarch64 (the one cross target)"
        cross=aarch64 ;;
    *) fail "usage: scripts/dist-test.sh [--target aarch64]" ;;
esac

version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
native="$(uname -m)"
dist="$PWD/dist"
tarball() { echo "$dist/hora-$1-$version-$2-linux.tar.gz"; } # $1: server|client, $2: arch

work="$(mktemp -d)"
server_pid=""
stop_server() {
    if [ -n "$server_pid" ]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
        server_pid=""
    fi
}
trap 'stop_server; rm -rf "$work"' EXIT
mkdir -p "$work/home" "$work/unpacked"

# unpack KIND ARCH: unpacks a tarball into the fresh directory and prints its binary's path.
unpack() {
    local tar
    tar="$(tarball "$1" "$2")"
    [ -f "$tar" ] || fail "$tar is missing: run make dist${cross:+ and make dist-$cross} first"
    tar -C "$work/unpacked" -xzf "$tar"
    echo "$work/unpacked/hora-$1-$version-$2-linux/bin/hora-$1"
}

# Runs a command as a user without the build cache: no LD_LIBRARY_PATH, a HOME of its own.
# Emulated aarch64 binaries get qemu-user and the aarch64 C library, as a device has its own.
bare() { env -i PATH=/usr/bin:/bin HOME="$work/home" QEMU_LD_PREFIX=/usr/aarch64-linux-gnu "$@"; }
# runner ARCH ROLE: how a binary of that architecture runs here. qemu emulates the oldest core
# each artefact supports, so that an instruction it lacks is caught here: the server a
# Cortex-A72 (Raspberry Pi 4, ARMv8.0-A); the client a Cortex-A76 (Raspberry Pi 5, ARMv8.2-A),
# since PyPI's aarch64 libtorch dies with SIGILL in its first training step on a Cortex-A72.
runner() {
    [ "$1" = "$native" ] && return
    if [ "$2" = server ]; then echo "qemu-$1 -cpu cortex-a72"; else echo "qemu-$1 -cpu cortex-a76"; fi
}

# check_libs ARCH CLIENT: the client's libraries are the ones beside it, none missing, no CUDA.
check_libs() {
    local libs
    if [ "$1" = "$native" ]; then
        libs="$(bare ldd "$2")"
    else
        libs="$(bare $(runner "$1" client) "/usr/$1-linux-gnu/lib/ld-linux-$1.so.1" --list "$2")"
    fi
    if grep -q 'not found' <<< "$libs"; then fail "the $1 client lacks libraries: $libs"; fi
    if grep -q libtorch_cuda <<< "$libs"; then fail "the $1 client carries CUDA: $libs"; fi
    grep -q "libtorch_cpu.so => $work/unpacked/hora-client-$version-$1-linux/" <<< "$libs" \
        || fail "libtorch_cpu does not come from the $1 tarball: $libs"
}

# serve ARCH SERVER NAME: starts the server, sets $url, $ca and $admin_token.
serve() {
    local run start
    run="$(runner "$1" server)"
    admin_token="$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')"
    start="$(date +%s%N)"
    # (Not through `bare`: a function in the background is a subshell, and $! would be its id.)
    env -i PATH=/usr/bin:/bin HOME="$work/home" QEMU_LD_PREFIX=/usr/aarch64-linux-gnu \
        $run "$2" serve --listen 127.0.0.1:0 --data-dir "$work/$3" --admin-token "$admin_token" \
        > "$work/$3.out" 2> "$work/$3.log" &
    server_pid=$!
    url=""
    for _ in $(seq 1 1200); do
        url="$(sed -n 's/^hora-server listening on //p' "$work/$3.out" | head -1)"
        [ -n "$url" ] && break
        kill -0 "$server_pid" 2>/dev/null || fail "the $1 server exited: $(cat "$work/$3.log")"
        sleep 0.1
    done
    [ -n "$url" ] || fail "the $1 server did not listen"
    ca="$work/$3/certs/ca.pem"
    log "$1 server up in $(ms_since "$start") ms at $url"
}
admin() { bare $(runner "$server_arch" server) "$server" admin --server "$url" --ca "$ca" --token "$admin_token" "$@"; }
enrolment() {
    local token
    token="$(admin enrol | sed -n 's/.*"token": *"\([^"]*\)".*/\1/p')"
    [ -n "$token" ] || fail "the server gave no enrolment token"
    echo "$token"
}

# task ARCH CLIENT ID ROUNDS: the client makes the initial weights; the task is created.
task() {
    local start init model digest
    start="$(date +%s%N)"
    init="$(bare $(runner "$1" client) "$2" init --model mlp --params '{"inputs":60,"hidden":[32],"classes":10}' \
        --output "$work/$3.safetensors")"
    log "$1 client init (libtorch loaded) in $(ms_since "$start") ms"
    model="$(sed -n 's/^model: //p' <<< "$init")"
    admin upload-model "$work/$3.safetensors" > "$work/$3-uploaded.json"
    digest="$(sed -n 's/.*"digest": *"\([0-9a-f]*\)".*/\1/p' "$work/$3-uploaded.json" | head -1)"
    [ -n "$digest" ] || fail "no digest in $(cat "$work/$3-uploaded.json")"
    cat > "$work/$3.json" <<EOF
{"id": "$3", "initial_model": "$digest", "model": $model, "rounds": $4, "min_clients": 1,
 "target_clients": 1, "round_deadline_secs": 600,
 "training": {"epochs": 1, "batch_size": 32, "learning_rate": 0.1}}
EOF
    admin create-task "$work/$3.json" > /dev/null
}

# train ARCH CLIENT ID ROUNDS: the client trains that many rounds of the task.
train() {
    local start token
    token="$(enrolment)"
    start="$(date +%s%N)"
    bare $(runner "$1" client) "$2" train --server "$url" --ca "$ca" --task "$3" --token "$token" \
        --data synthetic-iid:clients=2,seed=1 --client-index 0 --state-dir "$work/$3-state" \
        --rounds "$4" --no-progress > "$work/$3-client.out" 2> "$work/$3-client.log" \
        || fail "the $1 client failed: $(cat "$work/$3-client.log")"
    grep -q "$4 rounds contributed" "$work/$3-client.out" || fail "$(cat "$work/$3-client.out")"
    log "$4 round(s) of $3 trained by the $1 client in $(ms_since "$start") ms"
}

# launch ARCH CLIENT: the tarball's hora-run starts two local workers, each told its rank.
launch() {
    local out
    out="$(bare $(runner "$1" client) "$(dirname "$2")/hora-run" -np 2 --no-tag -- \
        sh -c 'echo "rank $HORA_RANK of $HORA_WORLD_SIZE"' | sort)" \
        || fail "the $1 hora-run failed: $out"
    [ "$out" = "$(printf 'rank 0 of 2\nrank 1 of 2')" ] || fail "the $1 hora-run's workers said: $out"
    log "the $1 hora-run started two workers with their ranks"
}

# published ID ROUNDS: the task finished with every round published.
published() {
    local rounds finished=""
    for _ in $(seq 1 600); do
        admin task "$1" | grep -q '"state": *"finished"' && { finished=1; break; }
        sleep 0.1
    done
    [ -n "$finished" ] || fail "task $1 did not finish within a minute: $(admin task "$1")"
    rounds="$(admin rounds "$1")"
    [ "$(grep -c '"status": *"published"' <<< "$rounds")" = "$2" ] || fail "rounds of $1: $rounds"
}

if [ -n "$cross" ]; then
    server_native="$(unpack server "$native")"
    client_native="$(unpack client "$native")"
    server_cross="$(unpack server "$cross")"
    client_cross="$(unpack client "$cross")"
    check_libs "$cross" "$client_cross"
    launch "$cross" "$client_cross"
    log "$(bare $(runner "$cross" server) "$server_cross" --version); $(bare $(runner "$cross" client) "$client_cross" --version)"

    server_arch="$native" server="$server_native"
    serve "$native" "$server" "data-$native"
    task "$cross" "$client_cross" "$cross-client" 2
    train "$cross" "$client_cross" "$cross-client" 2
    published "$cross-client" 2
    stop_server

    server_arch="$cross" server="$server_cross"
    serve "$cross" "$server" "data-$cross"
    task "$native" "$client_native" "$cross-server" 2
    train "$native" "$client_native" "$cross-server" 2
    published "$cross-server" 2
    log "an emulated $cross client trained against the $native server, and an emulated $cross server served a $native client: both tasks published every round"
    exit 0
fi

wheel="$(ls "$dist"/hora-"$version"-*abi3*.whl 2>/dev/null | head -1 || true)"
[ -f "$wheel" ] || fail "the wheel is missing: run make dist first"
server_arch="$native" server="$(unpack server "$native")"
client="$(unpack client "$native")"
check_libs "$native" "$client"
launch "$native" "$client"
log "$(bare "$server" --version); $(bare "$client" --version)"

serve "$native" "$server" data
task "$native" "$client" dist 2
# Round 1: the client's tarball.
train "$native" "$client" dist 1

# The wheel keeps its manylinux promise: no glibc symbol newer than its tag's (2.28).
command -v objdump > /dev/null || fail "objdump (binutils) is needed to check the wheel's glibc symbols"
python3 - "$wheel" <<'EOF' || fail "the wheel's glibc check failed (above)"
import re, subprocess, sys, tempfile, zipfile
wheel = sys.argv[1]
tag = re.search(r"manylinux_(\d+)_(\d+)", wheel)
assert tag, f"{wheel}: not a manylinux wheel"
allowed = (int(tag[1]), int(tag[2]))
with tempfile.TemporaryDirectory() as d, zipfile.ZipFile(wheel) as z:
    for name in (n for n in z.namelist() if n.endswith(".so")):
        path = z.extract(name, d)
        symbols = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True).stdout
        needed = max(((int(a), int(b)) for a, b in re.findall(r"GLIBC_(\d+)\.(\d+)", symbols)), default=(0, 0))
        assert needed <= allowed, f"{name} needs glibc {needed}, the tag allows {allowed}"
        print(f"dist-test: {name} needs glibc {needed[0]}.{needed[1]} (manylinux_{allowed[0]}_{allowed[1]})", file=sys.stderr)
EOF

# Round 2: the wheel, in a fresh virtual environment (numpy from the package index).
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --disable-pip-version-check "$wheel"
(cd "$work" && bare "$work/venv/bin/python" - "$url" "$ca" "$(enrolment)" <<'EOF'
import sys
import numpy as np
import hora

url, ca, token = sys.argv[1:]
def train(weights, config):
    # One step towards zero: an update the server must fold.
    return {k: v * 0.5 for k, v in weights.items()}, 10, {"loss": 1.0}
run = hora.Client(url, ca, "py-state", token=token).run("dist", train, rounds=1)
assert run["rounds"][0]["outcome"] == "uploaded", run
print("python client:", hora.__name__, run["rounds"][0]["round"])
EOF
) > "$work/python.out" 2> "$work/python.log" || fail "the wheel's client failed: $(cat "$work/python.log")"
log "round 2 trained by the wheel ($(bare "$work/venv/bin/python" -c 'import sys; print(sys.version.split()[0])'))"

published dist 2
log "both rounds published: the artefacts work without the build cache"
