#!/usr/bin/env bash
# Install mpsd and run its main job, `mpsd run`, for a few seconds on any Debian machine.
#
# On a GPU node the driver provides nvidia-cuda-mps-control and you would run
# `mpsd run --config /etc/mpsd/config.yaml` directly. Without a GPU this script fetches the real
# control binary from Debian's non-free archive into .cache/mps (no system change), supervises
# it with mpsd under a temporary pipe directory, shows `mpsd status`, the probes and metrics,
# and a client environment from `mpsd exec`, then stops it with SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q .
# Import from the repository root (tests/mpsbin.py), not from the installed copy's directory.
control=$(PYTHONPATH=. .venv/bin/python -c 'from tests.mpsbin import ensure_mps_control; print(ensure_mps_control())')
work=$(mktemp -d)
port=${MPSD_DEMO_PORT:-19400}
args=(--control-binary "$control" --pipe-dir "$work/pipe" --log-dir "$work/log" --state-dir "$work/state"
      --metrics-address "127.0.0.1:$port" --active-thread-percentage 50 --pinned-mem-limit 0=8G --health-interval 1s)
mpsd=(.venv/bin/mpsd)
"${mpsd[@]}" run "${args[@]}" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 1 100); do
    if .venv/bin/python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/readyz', timeout=1)" 2>/dev/null; then break; fi
    sleep 0.2
done
echo "--- mpsd status"
"${mpsd[@]}" status --control-binary "$control" --pipe-dir "$work/pipe" --log-dir "$work/log" --pinned-mem-limit 0=8G
echo "--- /readyz and a few metrics"
.venv/bin/python - "$port" <<'PY'
import sys, urllib.request
port = sys.argv[1]
print(urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz").read().decode().strip())
for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode().splitlines():
    if line.startswith(("mpsd_daemon_up", "mpsd_daemon_restarts_total", "mpsd_config_generation")):
        print(line)
PY
echo "--- a client's environment under mpsd exec (4G cap, 25% of the SMs)"
"${mpsd[@]}" exec --pipe-dir "$work/pipe" --state-dir "$work/state" --gpu-memory 4G --gpu-compute 25 -- env \
    | grep -E '^(CUDA_MPS_|LD_PRELOAD|MPSSHIM_)' | sort
echo "--- SIGTERM"
kill -TERM $pid
wait $pid && echo "mpsd exited 0; no control daemon left: $(pgrep -f "$work/pipe" >/dev/null && echo no || echo yes)"
trap 'rm -rf "$work"' EXIT
