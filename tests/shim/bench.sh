#!/usr/bin/env bash
# Cost of the shim on an alloc+free pair (cuMemAlloc_v2 + cuMemFree_v2 reached through
# cuGetProcAddress_v2), against the fake driver: no shim, shim without caps, shim with a cap.
# Usage: tests/shim/bench.sh [PAIRS] [ROUNDS]   (prints nanoseconds per pair, one line per run)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
pairs="${1:-1000000}"
rounds="${2:-3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
make -s -C "$root/csrc" OUT="$work/libmpsshim.so" lib
make -s -C "$root/tests/fakes" OUT_DIR="$work" cuda
cc -std=gnu11 -O2 -I"$root/csrc" "$root/tests/shim/cuclient.c" -o "$work/cuclient" -ldl -lpthread
export LD_LIBRARY_PATH="$work" FAKE_CUDA_DEVICES=16G MPSSHIM_REGION="$work/bench.region"
run() { "$work/cuclient" gpa2 12000 0 init ctx 0 bench "$pairs" 4096 | sed -n 's/^bench rc=0 //p'; }
for _ in $(seq "$rounds"); do
    echo "no shim:       $(run)"
    echo "shim, no cap:  $(LD_PRELOAD="$work/libmpsshim.so" run)"
    echo "shim, capped:  $(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G LD_PRELOAD="$work/libmpsshim.so" run)"
done
