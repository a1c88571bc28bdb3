"""JAX and CuPy under libmpsshim on a real GPU: they size themselves to the cap, and CuPy's
cuMemAllocAsync pool is capped. Skipped where the framework does not import."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

from tests.gpu.conftest import clean_env

GIB = 1 << 30


def _env(shim_lib: Path, region: Path, limit: str, **extra: str) -> dict[str, str]:
    return clean_env(
        LD_PRELOAD=str(shim_lib), MPSSHIM_REGION=str(region), CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=limit, **extra
    )


def _run(python: str, code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=300)


JAX = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    x = jnp.ones((1024, 1024)); x.block_until_ready()
    stats = jax.devices()[0].memory_stats()
    print(stats["bytes_limit"], stats.get("bytes_reserved", 0))
    """
)


def test_jax_preallocates_its_fraction_of_the_cap(python_with, shim_lib, tmp_path, record):
    """XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of what cuMemGetInfo says: the cap."""
    python = python_with("jax", "import jax; assert jax.devices()[0].platform == 'gpu'")
    out = _run(python, JAX, _env(shim_lib, tmp_path / "region", "0=4G"))
    record(stdout=out.stdout.strip(), stderr=out.stderr.strip()[-500:])
    assert out.returncode == 0, out.stderr
    limit = int(out.stdout.split()[0])
    assert 0 < limit <= 4 * GIB, limit
    assert limit >= int(0.70 * 4 * GIB), f"JAX took {limit} of a 4 GiB cap; the 0.75 default gives about 3 GiB"


CUPY_INFO = "import cupy; free, total = cupy.cuda.runtime.memGetInfo(); print(free, total)"

CUPY_ASYNC = textwrap.dedent(
    """
    import sys, cupy
    cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
    a = cupy.empty(GIB, dtype=cupy.uint8)
    try:
        b = cupy.empty(2 * GIB, dtype=cupy.uint8)
    except cupy.cuda.memory.OutOfMemoryError:
        print("OOM"); sys.exit(3)
    print("PASSED")
    """
).replace("GIB", str(GIB))


def test_cupy_sees_the_cap(python_with, shim_lib, tmp_path):
    python = python_with("cupy", "import cupy; cupy.cuda.runtime.getDeviceCount()")
    out = _run(python, CUPY_INFO, _env(shim_lib, tmp_path / "region", "0=2G"))
    assert out.returncode == 0, out.stderr
    free, total = map(int, out.stdout.split())
    assert total == 2 * GIB and 0 < free <= 2 * GIB


def test_cupy_async_pool_is_capped(python_with, shim_lib, tmp_path):
    """cuMemAllocAsync through CuPy's MemoryAsyncPool: 1 GiB fits a 2 GiB cap, 2 GiB more does not."""
    python = python_with("cupy", "import cupy; cupy.cuda.runtime.getDeviceCount()")
    out = _run(python, CUPY_ASYNC, _env(shim_lib, tmp_path / "region", "0=2G"))
    assert out.returncode == 3, out.stdout + out.stderr


JAX_HOLD = textwrap.dedent(
    """
    import sys, jax.numpy as jnp
    x = jnp.ones((int(sys.argv[1]) << 18,), dtype=jnp.float32); x.block_until_ready()  # argv[1] MiB
    print("held", flush=True)
    sys.stdin.readline()
    """
)


def test_two_jax_processes_share_a_cap_with_mpsds_variables(python_with, shim_lib, tmp_path, record):
    """Two JAX processes in one 4 GiB region with the variables every face gives (mpsd.alloc.frameworks):
    1 GiB and 2 GiB both fit; JAX's default would have preallocated 3 GiB in the first."""
    from mpsd.alloc.frameworks import framework_env

    python = python_with("jax", "import jax; assert jax.devices()[0].platform == 'gpu'")
    env = _env(shim_lib, tmp_path / "region", "0=4G", **framework_env())
    first = subprocess.Popen([python, "-c", JAX_HOLD, "1024"], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held", first.stderr.read()[-500:]
        second = subprocess.run([python, "-c", JAX_HOLD, "2048"], env=env, input="\n", capture_output=True,
                                text=True, timeout=300)
        record(second_rc=second.returncode, second_out=second.stdout.strip(), second_err=second.stderr.strip()[-500:])
        assert second.returncode == 0 and "held" in second.stdout, second.stderr[-500:]
    finally:
        first.communicate("\n", timeout=120)
