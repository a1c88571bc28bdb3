#!/usr/bin/env bash
# Cost of the shim on an alloc+free pair, quickly: the cuGetProcAddress path, 4 KiB, one thread,
# one process, this checkout's shim against the fake driver. A shorthand for
# benchmarks/shim_alloc.py (see docs/benchmarks.md), which measures every shape.
# Usage: tests/shim/bench.sh [PAIRS] [ROUNDS]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="$root/.venv/bin/python"
[ -x "$python" ] || python=python3
exec "$python" "$root/benchmarks/shim_alloc.py" --paths gpa --sizes 4096 --threads 1 --procs 1 \
    --pairs "${1:-1000000}" --rounds "${2:-3}"
