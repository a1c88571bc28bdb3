"""What a container gets for its slice, whichever face asked (Allocate, a DRA claim's CDI spec):
environment and mounts, as pure functions of its plan.

Paths inside the container are fixed by the configuration contract; host paths come from
the configuration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .clientenv import client_env
from ..errors import PluginError
from .shimfile import CONTAINER_SHIM_DIR, SHIM_NAME, container_shim
from .slicing import Plan

CONTAINER_REGION_DIR = "/run/mpsd"
CONTAINER_REGION = "/run/mpsd/region"
IPC_MODES = ("hostIPC", "tmpfs")
LOG_FIFO = "log"  # the control daemon's log FIFO in the pipe dir
DEV_NULL = "/dev/null"


@dataclass(frozen=True)
class Mount:
    host: str
    container: str
    read_only: bool


@dataclass(frozen=True)
class HostPaths:
    pipe_dir: str
    region_dir: str  # parent: one subdirectory per allocation
    shim_host_dir: str
    ipc_mode: str = "hostIPC"
    shm_dir: str = ""

    def __post_init__(self) -> None:
        # the kubelet hands these to the container runtime as mount sources (and the pipe dir
        # as a mount target too): relative paths would resolve against the runtime's cwd
        for key, value in (("pipeDir", self.pipe_dir), ("regionDir", self.region_dir),
                           ("shimHostDir", self.shim_host_dir), ("shmDir", self.shm_dir)):
            if value and not os.path.isabs(value):
                raise PluginError(f"bad {key} {value!r}: expected an absolute host path (pods mount it)")
        if self.ipc_mode not in IPC_MODES:
            raise PluginError(f"bad ipcMode {self.ipc_mode!r}: expected one of {', '.join(IPC_MODES)}")
        if self.ipc_mode == "tmpfs" and not self.shm_dir:
            raise PluginError("ipcMode tmpfs needs shmDir: expected a host directory (a tmpfs shared with the daemon)")

    def allocation_dir(self, name: str) -> str:
        return os.path.join(self.region_dir, name)


def container_env(plan: Plan, pipe_dir: str, client_priority: int | None = None,
                  shim: str = SHIM_NAME) -> dict[str, str]:
    """The environment of a container holding ``plan`` (Allocate; DRA's CDI spec, which may add
    the claim's client priority). ``shim``: the shim file it preloads (a claim prepared before an
    upgrade keeps the one it was prepared with: mpsd/alloc/shimfile.py)."""
    env = client_env(
        pipe_dir=pipe_dir,
        active_thread_percentage=plan.active_thread_percentage,
        memory_limits=plan.memory_limits,
        shim_library=container_shim(shim),
        region_path=CONTAINER_REGION,
        client_priority=client_priority,
    )
    env["NVIDIA_VISIBLE_DEVICES"] = plan.visible_devices
    return env


def container_mounts(plan: Plan, paths: HostPaths, region_dir: str) -> list[Mount]:
    """``region_dir``: this container's own directory in regionDir (fresh for each Allocate)."""
    mounts = [
        # read-only: clients only connect() to the daemon's sockets, which Linux allows on a
        # read-only mount; a pod that could write here could plant its own sockets (an impostor
        # daemon), rename or delete the daemon's
        Mount(host=paths.pipe_dir, container=paths.pipe_dir, read_only=True),
        # the daemon's log FIFO: a read-only mount does not stop writes into a FIFO, and a pod
        # that fills it (64 KiB) stops the daemon answering anyone. /dev/null over it in the
        # pod's view takes what the pod writes (docs/security.md: the daemon makes a new FIFO at
        # each start, which the kernel lets detach this mount in pods started before it)
        Mount(host=DEV_NULL, container=os.path.join(paths.pipe_dir, LOG_FIFO), read_only=True),
        Mount(host=region_dir, container=CONTAINER_REGION_DIR, read_only=False),
        Mount(host=paths.shim_host_dir, container=CONTAINER_SHIM_DIR, read_only=True),
    ]
    if paths.ipc_mode == "tmpfs":
        mounts.append(Mount(host=paths.shm_dir, container="/dev/shm", read_only=False))
    return mounts

