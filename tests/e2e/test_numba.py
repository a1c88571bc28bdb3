"""numba (its own ctypes binding: dlopen of the driver, dlsym of "_v2" names) as a real
third-party client of the shim on the fake driver. numba finds the fake as "libcuda.so" on
LD_LIBRARY_PATH; the fake carries the few extra entry points numba's binding resolves at start
(attributes, primary-context state, an IPC symbol). Kernels and copies are not faked."""
from __future__ import annotations

import pytest

pytest.importorskip("numba")

M = 1 << 20

CLIENT = """
import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError
ctx = cuda.current_context()
d = Driver()  # the same libcuda.so.1 numba loaded, for the fake's probes
info0 = tuple(ctx.get_memory_info())
a = cuda.device_array(48 << 20, dtype=np.uint8)
info1 = tuple(ctx.get_memory_info())
try:
    cuda.device_array(32 << 20, dtype=np.uint8)
    refused = None
except CudaAPIError as exc:
    refused = int(exc.code)
used = d.fake_used(0)
del a
ctx.deallocations.clear()
whole = cuda.device_array(64 << 20, dtype=np.uint8)
emit(info0=info0, info1=info1, refused=refused, used=used, whole=whole.nbytes, final=d.fake_used(0),
     device=cuda.get_current_device().name.decode())
"""


def test_numba_sees_the_cap_and_is_refused_past_it(run_py, shim_env):
    r = run_py(CLIENT, shim_env(limit="0=64M", devices="16G"), timeout=120)
    assert r.one == {
        "info0": [64 * M, 64 * M],
        "info1": [16 * M, 64 * M],
        "refused": 2,
        "used": 48 * M,
        "whole": 64 * M,
        "final": 64 * M,
        "device": "Fake CUDA Device 0",
    }
    assert "cuMemAlloc_v2 refused with CUDA_ERROR_OUT_OF_MEMORY: device 0 cap 67108864 bytes" in r.stderr


def test_numba_without_the_shim_sees_the_whole_fake_device(run_py, fake_env):
    r = run_py(
        """
        from numba import cuda
        emit(info=tuple(cuda.current_context().get_memory_info()))
        """,
        fake_env(devices="16G"),
        timeout=120,
    )
    assert r.one == {"info": [16 << 30, 16 << 30]}
