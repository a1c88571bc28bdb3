"""Environment that makes frameworks live within a capped slice. Pure.

The shim makes cuMemGetInfo and cuDeviceTotalMem report the cap, so every framework sizes
itself to the slice without code changes. What remains is preallocation: TensorFlow grabs
nearly all reported free memory at start and JAX 75% of the total. That is harmless for one
process per cap, but when several processes share one cap (one region), the first one would
take the whole slice; these variables make those frameworks allocate on demand instead.
PyTorch and CuPy allocate on demand already and need nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from mpsd.errors import ConfigError

_ON_DEMAND = {
    "tensorflow": {"TF_FORCE_GPU_ALLOW_GROWTH": "true"},
    "jax": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "pytorch": {},
    "cupy": {},
}
FRAMEWORKS = tuple(_ON_DEMAND)


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
