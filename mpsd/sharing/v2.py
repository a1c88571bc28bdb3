"""The MPS v2 backend: today's behaviour. One node-wide MPS daemon; a slice is the client
environment (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT,
CUDA_MPS_CLIENT_PRIORITY) plus the shim preloaded over a private region directory, and the
pipe directory mounted read-only (mpsd/alloc/container.py has the pure functions). Nothing is
created on the node per slice: grant, release and adopt change nothing. The MPS server caps each
client process, the shim each container; neither can lend memory above a guarantee, so a burst
limit (a hard limit above the guarantee) is refused."""

from __future__ import annotations

from typing import Iterable

from ..daemon import dirs
from ..errors import BackendError
from ..alloc.container import HostPaths, container_env, container_mounts
from ..units import format_size_mps_control
from . import Grant, SliceRequest

NAME = "mps-v2"
BURST = ("MPS v2 caps a slice at its guarantee (the shim and the MPS server's per-client limit); burst needs "
         "MPS v3 with memory partitioning")


class V2Backend:
    name = NAME

    def __init__(self, paths: HostPaths) -> None:
        self.paths = paths

    def edits(self, request: SliceRequest) -> Grant:
        env = container_env(request.plan, self.paths.pipe_dir, client_priority=request.client_priority,
                            shim=request.shim)
        mounts = tuple(container_mounts(request.plan, self.paths, request.region_dir))
        return Grant(env, mounts)

    def grant(self, request: SliceRequest) -> Grant:
        check_no_burst(request, BURST)
        dirs.keep_log_target(self.paths.pipe_dir)  # the mount over the daemon's log FIFO needs it
        return self.edits(request)

    def release(self, key: str) -> None:
        return None

    def adopt(self, requests: Iterable[SliceRequest]) -> None:
        return None

    def burst_problem(self) -> str:
        return BURST

    def enforcement(self, request: SliceRequest) -> str:
        return "memory: shim per container and MPS per client (v2); compute: client environment"


def check_no_burst(request: SliceRequest, why: str) -> None:
    """BackendError when ``request`` asks for a hard limit above a guarantee this backend cannot lend."""
    for share in request.plan.gpus:
        hard = request.memory_hard.get(share.ordinal, 0)
        if hard > share.memory_limit:
            raise BackendError(
                f"{request.key}: memory limit {format_size_mps_control(hard)} above the guarantee "
                f"{format_size_mps_control(share.memory_limit)} on {share.uuid} cannot be enforced here: {why}"
            )
