"""What a container gets from Allocate: environment and mounts, as a pure function of its plan.

Paths inside the container are fixed by the configuration contract; host paths come from
the configuration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..clientenv import client_env
from ..errors import PluginError
from . import api_pb2
from .slicing import Plan

CONTAINER_REGION_DIR = "/run/mpsd"
CONTAINER_REGION = "/run/mpsd/region"
CONTAINER_SHIM_DIR = "/run/mpsd-shim"
SHIM_NAME = "libmpsshim.so"
CONTAINER_SHIM = f"{CONTAINER_SHIM_DIR}/{SHIM_NAME}"
IPC_MODES = ("hostIPC", "tmpfs")


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


def container_env(plan: Plan, pipe_dir: str, client_priority: int | None = None) -> dict[str, str]:
    """The environment of a container holding ``plan`` (Allocate; DRA's CDI spec, which may add
    the claim's client priority)."""
    env = client_env(
        pipe_dir=pipe_dir,
        active_thread_percentage=plan.active_thread_percentage,
        memory_limits=plan.memory_limits,
        shim_library=CONTAINER_SHIM,
        region_path=CONTAINER_REGION,
        client_priority=client_priority,
    )
    env["NVIDIA_VISIBLE_DEVICES"] = plan.visible_devices
    return env


def container_mounts(plan: Plan, paths: HostPaths, region_dir: str) -> list[api_pb2.Mount]:
    """``region_dir``: this container's own directory in regionDir (fresh for each Allocate)."""
    mounts = [
        # read-only: clients only connect() to the daemon's sockets, which Linux allows on a
        # read-only mount; a pod that could write here could plant its own sockets (an impostor
        # daemon), rename or delete the daemon's
        api_pb2.Mount(container_path=paths.pipe_dir, host_path=paths.pipe_dir, read_only=True),
        api_pb2.Mount(container_path=CONTAINER_REGION_DIR, host_path=region_dir, read_only=False),
        api_pb2.Mount(container_path=CONTAINER_SHIM_DIR, host_path=paths.shim_host_dir, read_only=True),
    ]
    if paths.ipc_mode == "tmpfs":
        mounts.append(api_pb2.Mount(container_path="/dev/shm", host_path=paths.shm_dir, read_only=False))
    return mounts


def container_response(plan: Plan, paths: HostPaths, region_dir: str) -> api_pb2.ContainerAllocateResponse:
    return api_pb2.ContainerAllocateResponse(
        envs=container_env(plan, paths.pipe_dir), mounts=container_mounts(plan, paths, region_dir)
    )
