#!/usr/bin/env bash
# Install mpsd, run its main job `mpsd run` for a few seconds, and show what it is for: two
# clients share one 4 GiB slice under `mpsd exec`, one holds 3 GiB, the other is refused 2 GiB.
#
# On a machine with a working nvidia-smi and nvidia-cuda-mps-control this uses the real GPU,
# driver and control daemon. Without them it is a SIMULATION, and says so: the control daemon
# is still the real nvidia-cuda-mps-control (fetched from Debian's non-free archive into
# .cache/mps, no system change), but the clients load the fake libcuda.so.1 and mpsd the fake
# libnvidia-ml.so.1 that the tests build from tests/fakes (a 16 GiB simulated GPU).
#
#   MPSD_DEMO_SIMULATE=1   simulate even where there is a GPU
#   MPSD_DEMO_PORT=19400   port of /metrics, /healthz and /readyz
#   MPSD_DEMO_PYTHON=PATH  use this interpreter's installed mpsd instead of installing into .venv
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${MPSD_DEMO_PYTHON:-}" ]; then
    py=$(realpath -s "$(command -v "$MPSD_DEMO_PYTHON")") # absolute, the venv link kept
else
    [ -x .venv/bin/python ] || python3 -m venv .venv
    .venv/bin/python -m pip install -q .
    py=$PWD/.venv/bin/python
fi
port=${MPSD_DEMO_PORT:-19400}
work=$(mktemp -d)
chmod 711 "$work" # clients of other users must reach the pipe directory inside (mpsd would warn and do it)
trap 'rm -rf "$work"' EXIT
# The installed mpsd and shim, run from $work: from the repository root, python -m would import
# the source tree, which holds no built libmpsshim.so after a plain `pip install .`.
mpsd=(env -C "$work" "$py" -m mpsd)
shim=(env -C "$work" "$py" -m shim)
client=$PWD/scripts/demo_client.py
section() { printf '\n--- %s\n' "$*"; }

if [ "${MPSD_DEMO_SIMULATE:-0}" != 1 ] && nvidia-smi -L >/dev/null 2>&1 && command -v nvidia-cuda-mps-control >/dev/null; then
    simulated=0
    control=$(command -v nvidia-cuda-mps-control)
    client_env=()
    nvml=()
    echo "=== real GPU: $(nvidia-smi -L | head -n 1)"
else
    simulated=1
    # Import from the repository root (tests/mpsbin.py), not from the installed copy's directory.
    control=$(PYTHONPATH=. "$py" -c 'from tests.mpsbin import ensure_mps_control; print(ensure_mps_control())')
    make -s -C tests/fakes OUT_DIR="$work/fakes" all
    printf 'gpu 0 GPU-face0000-0000-0000-0000-000000000000 %d 0 9 0 0 Simulated GPU\n' $((16 << 30)) >"$work/nvml.conf"
    client_env=(LD_LIBRARY_PATH="$work/fakes" FAKE_CUDA_DEVICES=16G)
    export FAKE_NVML_CONFIG="$work/nvml.conf"
    nvml=(--nvml-library "$work/fakes/libnvidia-ml.so.1")
    echo "=== SIMULATION: no NVIDIA GPU here. The MPS control daemon is the real nvidia-cuda-mps-control;"
    echo "    the GPU is simulated: clients load a fake libcuda.so.1 (one 16 GiB device) and mpsd a fake"
    echo "    NVML, both built from tests/fakes. The clients never reach the MPS daemon: no server starts."
fi

common=(--control-binary "$control" --pipe-dir "$work/pipe" --log-dir "$work/log" --state-dir "$work/state")
"${mpsd[@]}" run "${common[@]}" "${nvml[@]}" --metrics-address "127.0.0.1:$port" \
    --active-thread-percentage 50 --pinned-mem-limit 0=8G --health-interval 1s --log-level warning &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$work"' EXIT
get() { "$py" -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode().strip())" \
    "http://127.0.0.1:$port/$1" 2>/dev/null; }
ready=$(for _ in $(seq 1 100); do get readyz && break; sleep 0.2; done)
section "mpsd run supervises the control daemon; /readyz: ${ready:-not ready}"
"${mpsd[@]}" status "${common[@]}" --active-thread-percentage 50 --pinned-mem-limit 0=8G "${nvml[@]}"

region=$work/state/exec/demo/region
mkdir -p "$(dirname "$region")"
exec_client=(env "${client_env[@]}" "${mpsd[@]}" exec "${common[@]}" --gpu-memory 4G --region "$region" --)
section "what mpsd exec gives a client: its MPS settings, the shim, the slice's region"
"${exec_client[@]}" env | grep -E '^(CUDA_MPS_|LD_PRELOAD|MPSSHIM_)' | sort

section "two clients of one 4 GiB slice: mpsd exec --gpu-memory 4G --region $region -- ..."
"${exec_client[@]}" "$py" "$client" A --allocate 3G --hold >"$work/a.out" 2>&1 &
holder=$!
trap 'kill -TERM $holder $pid 2>/dev/null || true; wait $holder $pid 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 1 100); do grep -q holding "$work/a.out" && break; sleep 0.1; done
cat "$work/a.out"
rc=0
timeout 60 "${exec_client[@]}" "$py" "$client" B --allocate 2G 2>&1 || rc=$?
echo "(B exited $rc: its allocation would pass the slice's cap)"

if [ "$simulated" = 0 ]; then
    section "mpsd status while client A holds its 3 GiB"
    "${mpsd[@]}" status "${common[@]}" --active-thread-percentage 50 --pinned-mem-limit 0=8G || true
fi

section "python -m shim usage $region"
"${shim[@]}" usage "$region"

section "/metrics of mpsd run: the slice from the shim's accounting of <stateDir>/exec/*/region"
metrics() {
    local all
    all=$(get metrics) || true
    grep -E '^(mpsd_region_|mpsd_client_memory_bytes)' <<<"$all" || true
    grep -E '^(mpsd_mps_(servers|clients)\{|mpsd_daemon_up|mpsd_daemon_restarts_total|mpsd_config_generation)' <<<"$all" || true
}
for _ in $(seq 1 50); do metrics | grep -q '^mpsd_region_process_memory_bytes' && break; sleep 0.2; done
metrics
if [ "$simulated" = 1 ]; then
    echo "(simulated: NVML's per-client series mpsd_client_memory_bytes{gpu,pid} stays empty, as no client reached MPS)"
fi

section "SIGTERM to client A, then to mpsd"
kill -TERM $holder
wait $holder || true
kill -TERM $pid
rc=0
wait $pid || rc=$?
trap 'rm -rf "$work"' EXIT
echo "mpsd exited $rc; control daemon left running: $(pgrep -f "$work/pipe" >/dev/null && echo yes || echo no)"
[ "$rc" = 0 ]
