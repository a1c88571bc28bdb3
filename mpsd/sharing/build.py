"""The node's backend from its config: which protocol (mpsd/sharing/detect.py), then the
backend the faces call."""

from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

from ..daemon.control3 import Control3
from ..alloc.container import HostPaths
from ..alloc.slicing import GpuLike
from . import Backend
from .detect import Choice, choose
from .v2 import V2Backend

log = logging.getLogger(__name__)


def host_paths(config) -> HostPaths:
    dp = config.device_plugin
    return HostPaths(pipe_dir=config.pipe_dir, region_dir=dp.region_dir, shim_host_dir=dp.shim_host_dir,
                     ipc_mode=dp.ipc_mode, shm_dir=dp.shm_dir)


def choose_for(config, driver_version: str | None) -> Choice:
    return choose(config.mps.protocol, config.control_binary, driver_version)


def build(config, choice: Choice, gpus: Callable[[], Sequence[GpuLike]], nvml=None):
    """The backend the faces call for ``choice`` (mpsd.lifecycle.v3.supervision_for adds what the
    supervisor does differently for v3); ``nvml``: the memory-limit calls
    (mpsd.sharing.memory.NvmlLimits) where NVML is loaded, None where it is not."""
    paths = host_paths(config)
    if choice.protocol == 2:
        return V2Backend(paths)
    from .memory import CgroupLimits
    from .owned3 import FILE, Owned
    from .toml3 import default_limits
    from .v3 import V3Backend

    memory, problem = None, "NVML is not available"
    if nvml is not None:
        memory = CgroupLimits(nvml, config.mps.cgroup_root)
        listed = list(gpus())
        mig = {g.index: bool(getattr(g, "mig_enabled", False)) for g in listed}
        problem = memory.available([g.index for g in listed], mig=lambda i: mig.get(i, False)) or (
            "" if listed else "NVML lists no GPU")
        if problem:
            memory = None
    log.info("memory partitioning by cgroup: %s", "available" if memory is not None else f"not used: {problem}")
    backend = V3Backend(
        paths=paths,
        control=lambda: Control3(config.control_binary, config.pipe_dir, config.log_dir, config.health_timeout),
        gpus=gpus,
        defaults=default_limits(config),
        uid=None if os.geteuid() == 0 else os.geteuid(),
        shim=config.mps.shim,
        memory=memory,
        memory_problem=problem,
        owned=Owned(os.path.join(config.state_dir, FILE)),
    )
    return backend


def describe(backend: Backend, choice: Choice) -> str:
    return f"{backend.name} ({choice.reason})"


def node_choice(config) -> Choice:
    """The choice for this node as ``mpsd run`` would make it (NVML opened for the driver's
    release, and closed again); SetupError when mps.protocol 3 cannot be had."""
    from ..errors import InventoryError

    driver = None
    if config.mps.protocol != "2":
        try:
            from ..inventory.nvml import Inventory

            with Inventory(library_path=config.nvml_library) as inventory:
                driver = inventory.driver_version()
        except (InventoryError, ImportError, OSError) as exc:
            log.info("driver version unknown: %s", exc)
    return choose_for(config, driver)


SHARING_FILE = "sharing.json"


def record(state_dir: str, backend: Backend, choice: Choice) -> dict:
    """What ``mpsd status`` shows of the running node's backend: written once at start into stateDir."""
    import json

    from ..alloc.state import write_atomic

    memory_problem = getattr(backend, "memory_problem", None)
    if choice.protocol == 2:
        memory = "the shim per container and the MPS server per client (v2)"
    elif memory_problem:
        memory = f"the namespace per client and the shim (the driver does not: {memory_problem})"
    else:
        memory = "the driver per cgroup (soft = guarantee, hard = limit); the shim where a slice's cgroup is not known"
    data = {"backend": backend.name, "protocol": choice.protocol, "reason": choice.reason, "memory": memory,
            "shim": config_shim(backend)}
    try:
        write_atomic(os.path.join(state_dir, SHARING_FILE), json.dumps(data, indent=1).encode())
    except (OSError, ValueError) as exc:  # status only: never a reason not to serve
        log.warning("%s not written: %s", SHARING_FILE, exc)
    return data


def config_shim(backend: Backend) -> str:
    return getattr(backend, "shim_mode", "on (v2: always)")


def read_record(state_dir: str) -> dict:
    import json

    try:
        with open(os.path.join(state_dir, SHARING_FILE), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
