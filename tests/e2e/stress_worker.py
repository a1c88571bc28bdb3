"""Child process for the stress test: THREADS threads allocate and free random sizes through the
driver (under the shim) for SECONDS, mixing cuMemAlloc_v2, cuMemAllocAsync_ptsz, cuMemCreate and
cuMemCreate + cuMemMap + cuMemRelease (freed by cuMemUnmap) with their frees, then free
everything and print one JSON line:
{"pid", "ops", "refused", "errors", "max_fake_used", "final_fake_used"}.

    python -m tests.e2e.stress_worker THREADS SECONDS MAX_BYTES SEED
"""
from __future__ import annotations

import random
import sys
import threading
import time
from typing import Any

from tests.e2e.cudrv import OUT_OF_MEMORY, CudaError, Driver, c_void_p, emit

KINDS = ("plain", "async", "vmm", "mapped")
_next_va = iter(range(0x700000000000, 1 << 48, 1 << 30))  # one GiB of address space per mapping
_va_lock = threading.Lock()


def map_released(d: Driver, n: int) -> tuple[int, int]:
    """A handle mapped and released at once: the mapping alone keeps the memory (and its charge)."""
    h = d.mem_create(n, 0)
    with _va_lock:
        va = next(_next_va)
    d.mem_map(va, n, h)
    d.mem_release(h)
    return va, n


ALLOC = {
    "plain": lambda d, n: d.alloc(n),
    "async": lambda d, n: d.alloc_async(n, ptsz=True),
    "vmm": lambda d, n: d.mem_create(n, 0),
    "mapped": map_released,
}
FREE = {
    "plain": lambda d, p: d.free(p),
    "async": lambda d, p: d.free_async(p, ptsz=True),
    "vmm": lambda d, h: d.mem_release(h),
    "mapped": lambda d, m: d.mem_unmap(*m),
}


def main(threads: int, seconds: float, max_bytes: int, seed: int) -> None:
    import ctypes
    import os

    d = Driver()
    d.call("cuInit", 0)
    ctx = c_void_p()
    d.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
    lock = threading.Lock()
    totals = {"ops": 0, "refused": 0, "max_fake_used": 0}
    errors: list[str] = []
    deadline = time.monotonic() + seconds

    def work(n: int) -> None:
        d.call("cuCtxSetCurrent", ctx)
        rng = random.Random(seed * 1000 + n)
        held: list[tuple[str, Any]] = []
        ops = refused = peak = 0
        while time.monotonic() < deadline:
            if held and rng.random() < 0.45:
                kind, key = held.pop(rng.randrange(len(held)))
                FREE[kind](d, key)
            else:
                kind = rng.choice(KINDS)
                try:
                    held.append((kind, ALLOC[kind](d, rng.randint(1, max_bytes))))
                except CudaError as exc:
                    if exc.code != OUT_OF_MEMORY:
                        errors.append(str(exc))
                    refused += 1
            ops += 1
            peak = max(peak, d.fake_used(0))
        for kind, key in held:
            FREE[kind](d, key)
        with lock:
            totals["ops"] += ops
            totals["refused"] += refused
            totals["max_fake_used"] = max(totals["max_fake_used"], peak)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    emit(pid=os.getpid(), errors=errors, final_fake_used=d.fake_used(0), **totals)


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
