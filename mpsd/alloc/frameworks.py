"""Environment that makes frameworks live within a capped slice: the one source of these
variables for every face (device plugin and DRA containers, ``mpsd exec``, ``shim.framework_env``).
Pure.

The shim makes cuMemGetInfo and cuDeviceTotalMem report the cap, so every framework sizes
itself to the slice without code changes. What remains is preallocation: TensorFlow grabs
nearly all reported free memory at start (free less 225 MiB under 2 GiB, gpu_device.cc's
MinSystemMemory: "Created device ... 799 MB" for a 1 GiB cap) and JAX 75% of the total
(3221225472 bytes of a 4 GiB cap, measured on an H100). That is harmless for one process per
cap, but when several processes share one cap (one region), the first one takes the slice and
the others' allocations are refused; these variables make those frameworks allocate on demand
instead. PyTorch, CuPy and numba allocate on demand already and need nothing (each keeps the
blocks it freed in its own cache until told otherwise: torch.cuda.empty_cache(),
cupy.get_default_memory_pool().free_all_blocks()).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import ConfigError

_ON_DEMAND = {
    "tensorflow": {"TF_FORCE_GPU_ALLOW_GROWTH": "true"},
    "jax": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "pytorch": {},
    "cupy": {},
}
FRAMEWORKS = tuple(_ON_DEMAND)
VARIABLES = frozenset(name for env in _ON_DEMAND.values() for name in env)  # every variable set here


def framework_env(frameworks: Iterable[str] = FRAMEWORKS, processes_share_cap: bool = True) -> dict[str, str]:
    """Variables for the named frameworks (default: all known); empty when one process has the
    cap to itself."""
    env: dict[str, str] = {}
    for name in frameworks:
        key = name.lower()
        if key not in _ON_DEMAND:
            raise ConfigError(f"unknown framework {name!r}: expected one of {', '.join(FRAMEWORKS)}")
        if processes_share_cap:
            env.update(_ON_DEMAND[key])
    return env
