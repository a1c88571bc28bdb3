"""A stand-in for a framework that preallocates device memory at start, over the CUDA driver
(the fake one here, through tests/e2e/cudrv.py), reading the same variables as the real one:

- ``jax``: preallocates XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of the *total* memory
  cuMemGetInfo reports, unless XLA_PYTHON_CLIENT_PREALLOCATE is false/0 or
  XLA_PYTHON_CLIENT_ALLOCATOR is platform (JAX's "GPU memory allocation" page). Measured under
  the shim on an H100: 3221225472 bytes of a 4 GiB cap.
- ``tensorflow``: unless TF_FORCE_GPU_ALLOW_GROWTH is true, preallocates the *free* memory
  less MinSystemMemory (225 MiB below 2 GiB free; tensorflow/core/common_runtime/gpu/
  gpu_device.cc, compute capability 8+: 1536 MiB above it). Seen under the shim over the fake
  driver with TensorFlow 2.21: "Created device ... 799 MB" for a 1 GiB cap.

Then it holds HOLD_MIB of its own (from its pool when it preallocated, else from the driver),
prints one JSON line and waits for a line on stdin before it exits. A refused allocation is the
framework's own out-of-memory error: {"oom": ...} and exit 3.

    python -m tests.e2e.preallocator jax|tensorflow HOLD_MIB
"""

from __future__ import annotations

import json
import os
import sys

from tests.e2e.cudrv import CudaError, Driver

M = 1 << 20


def pool_size(framework: str, free: int, total: int, env: dict[str, str]) -> int:
    """What the framework preallocates at start (0: it allocates on demand)."""
    if framework == "jax":
        off = env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").strip().lower() in ("0", "false")
        if off or env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").strip().lower() == "platform":
            return 0
        fraction = float(env.get("XLA_CLIENT_MEM_FRACTION") or env.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or 0.75)
        return int(total * fraction)
    if framework == "tensorflow":
        if env.get("TF_FORCE_GPU_ALLOW_GROWTH", "").lower() == "true":
            return 0
        return max(0, free - (225 * M if free < 1 << 31 else 1536 * M))
    raise SystemExit(f"unknown framework {framework!r}: expected jax or tensorflow")


def main(framework: str, hold_mib: int) -> int:
    d = Driver()
    d.init()
    free, total = d.mem_info()
    pool = pool_size(framework, free, total, dict(os.environ))
    try:
        if pool:
            d.alloc(pool)
        if hold_mib * M > (pool or 1 << 62):
            raise CudaError("pool", 2)
        if not pool:
            d.alloc(hold_mib * M)
    except CudaError as exc:
        print(json.dumps({"framework": framework, "preallocated": pool, "oom": exc.func}), flush=True)
        return 3
    print(json.dumps({"framework": framework, "preallocated": pool, "held": hold_mib * M}), flush=True)
    sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
