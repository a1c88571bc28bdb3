"""The environment an MPS client needs, as a pure function of the slice it was given.

Used by ``mpsd exec`` (one process on a node), the device plugin's Allocate (a container) and
the DRA driver's CDI specs (a claim's containers). Paths are the ones the client will see.
"""

from __future__ import annotations

from .frameworks import framework_env
from ..units import Limits, format_limits


def client_env(
    *,
    pipe_dir: str,
    active_thread_percentage: float | None = None,
    memory_limits: Limits | None = None,
    shim_library: str | None = None,
    region_path: str | None = None,
    log_dir: str | None = None,
    client_priority: int | None = None,
) -> dict[str, str]:
    """Variables for one client.

    ``memory_limits`` is keyed the way the client sees its devices (ordinals after
    CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES, or UUIDs). With ``shim_library`` the shim
    is preloaded and enforces the same limits for all processes sharing ``region_path``: they
    share one cap, so frameworks that would preallocate are told to allocate on demand
    (mpsd.alloc.frameworks).
    """
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir}
    if log_dir:
        env["CUDA_MPS_LOG_DIRECTORY"] = log_dir
    if active_thread_percentage is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = _percent(active_thread_percentage)
    if client_priority is not None:  # 0 normal, 1 below normal: a client can only lower its own
        env["CUDA_MPS_CLIENT_PRIORITY"] = str(int(client_priority))
    if memory_limits:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = format_limits(memory_limits)
    if shim_library:
        env["LD_PRELOAD"] = shim_library
        if region_path:
            env["MPSSHIM_REGION"] = region_path
        env.update(framework_env())
    return env


def _percent(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
