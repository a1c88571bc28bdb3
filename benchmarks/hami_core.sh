#!/usr/bin/env bash
# Build HAMi-core's libvgpu.so against this repository's fake driver, to measure it beside the
# shim (benchmarks/shim_alloc.py and shim_instructions.py take it with --hami LABEL=PATH).
#
#   benchmarks/hami_core.sh SRC OUT      # prints the path of the library built
#
# SRC is a HAMi-core source tree (e.g. `git archive` of a checkout of Project-HAMi/HAMi-core).
# Its build wants a CUDA toolkit for cuda.h and nvml.h only: they come from NVIDIA's PyPI
# wheels (nvidia-cuda-runtime-cu12, nvidia-nvml-dev-cu12), and it links against tests/fakes'
# libcuda.so and libnvidia-ml.so. Built as HAMi-core's build.sh does (its CMake options, a Debug
# build: no optimisation flags), without its test programs (they need nvcc). Everything goes
# under OUT; SRC is not changed.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 HAMI_CORE_SRC OUT_DIR" >&2; exit 2; }
root="$(cd "$(dirname "$0")/.." && pwd)"
src="$(cd "$1" && pwd)"
out="$(mkdir -p "$2" && cd "$2" && pwd)"
[ -f "$src/src/libvgpu.c" ] || { echo "$src is not a HAMi-core source tree (no src/libvgpu.c)" >&2; exit 2; }
python="$root/.venv/bin/python"
[ -x "$python" ] || python=python3

mkdir -p "$out/wheels" "$out/cuda/include" "$out/fake"
"$python" -m pip download -q --no-deps -d "$out/wheels" nvidia-cuda-runtime-cu12==12.9.79 nvidia-nvml-dev-cu12==12.9.79
for whl in "$out"/wheels/*.whl; do
    "$python" -m zipfile -e "$whl" "$out/wheels/x"
done
cp "$out"/wheels/x/nvidia/cuda_runtime/include/*.h "$out"/wheels/x/nvidia/nvml_dev/include/nvml.h "$out/cuda/include/"

make -s -C "$root/tests/fakes" OUT_DIR="$out/fake" "LDFLAGS=-shared -Wl,-Bsymbolic-functions" cuda nvml
ln -sf libnvidia-ml.so.1 "$out/fake/libnvidia-ml.so"

rm -rf "$out/src" && cp -r "$src" "$out/src"
sed -i 's/^add_subdirectory(test)/# add_subdirectory(test)/' "$out/src/CMakeLists.txt"
mkdir -p "$out/src/build"
cd "$out/src/build"
export CUDA_HOME="$out/cuda" LIBRARY_PATH="$out/fake"
cmake .. -DDLSYM_HOOK_ENABLE=1 -DMULTIPROCESS_LIMIT_ENABLE=1 -DHOOK_MEMINFO_ENABLE=1 -DHOOK_NVML_ENABLE=1 \
    -DCMAKE_BUILD_TYPE=Debug -DTEST_DEVICE_ID=0 >cmake.log 2>&1 || { tail -20 cmake.log >&2; exit 1; }
make -j"$(nproc)" vgpu >make.log 2>&1 || { grep -E 'error' make.log | head -20 >&2; exit 1; }
echo "$out/src/build/libvgpu.so"
