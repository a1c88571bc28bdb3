"""Slices of MIG instances: MPS v2 on the instance's own daemon (mpsd/mig/fleet.py).

A client reaches one MPS control daemon (one CUDA_MPS_PIPE_DIRECTORY), and each instance has its
own, so a slice is on exactly one instance: a request that spans two instances, or an instance and
a whole GPU, is refused in one line. What the container gets is MPS v2's (mpsd/sharing/v2.py)
with the instance's pipe dir: the limits in its environment (device 0: the server sees the
instance as its only device), the shim over its own region, NVIDIA_VISIBLE_DEVICES=MIG-<uuid>
(the container runtime then gives it the instance's /dev/nvidia-caps nodes). MPS v3's memory
partitioning does not run on MIG (NVIDIA: "MPS v3 Memory Partitioning" needs a non-MIG device),
so MIG slices stay on v2 whichever backend the whole GPUs use.

:class:`Routed` is the node's backend when some GPUs are in MIG mode: MIG requests to
:class:`MigBackend`, the rest to the node's own backend.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from ..errors import BackendError
from ..inventory.mig import MigDevice
from ..alloc.container import HostPaths
from ..daemon.smpartition import Partitions, chunks_for
from . import Backend, Grant, SliceRequest
from .v2 import V2Backend, check_no_burst

log = logging.getLogger(__name__)

NAME = "mps-v2-mig"
BURST = "a MIG instance's slices are capped at their guarantee (the shim and the MPS server's per-client limit)"


def is_mig(request: SliceRequest) -> bool:
    return any(share.uuid.startswith("MIG-") for share in request.plan.gpus)


class MigBackend:
    name = NAME

    def __init__(self, paths: HostPaths, pipe_dir: Callable[[str], str | None], *,
                 device: Callable[[str], MigDevice | None] = lambda uuid: None,
                 partitions: Partitions | None = None) -> None:
        self.paths = paths  # the node's: regionDir, shimHostDir, ipcMode, shmDir
        self.pipe_dir = pipe_dir  # MIG UUID -> its daemon's pipe dir; None when not served (MigFleet.pipe_dir)
        self.device = device  # MIG UUID -> the MigDevice served (MigFleet.device)
        self.partitions = partitions  # static SM partitions of the instances that have them

    def _instance(self, request: SliceRequest) -> tuple[str, str]:
        uuids = [share.uuid for share in request.plan.gpus]
        if len(uuids) != 1 or not uuids[0].startswith("MIG-"):
            raise BackendError(f"{request.key}: devices {','.join(uuids)} are on more than one MPS daemon: a slice "
                               "of a MIG instance is on that instance only (each has its own daemon and pipe dir)")
        pipe_dir = self.pipe_dir(uuids[0])
        if pipe_dir is None:
            raise BackendError(f"{request.key}: MIG instance {uuids[0]} is not served on this node (the MIG layout "
                               "changed, or its daemon could not start)")
        return uuids[0], pipe_dir

    def edits(self, request: SliceRequest) -> Grant:
        """The container's edits; for an instance with static SM partitions its partition is made
        here when the running daemon has none for this slice (a grant, a restart's adoption)."""
        uuid, pipe_dir = self._instance(request)
        paths = HostPaths(pipe_dir=pipe_dir, region_dir=self.paths.region_dir, shim_host_dir=self.paths.shim_host_dir,
                          ipc_mode=self.paths.ipc_mode, shm_dir=self.paths.shm_dir)
        grant = V2Backend(paths).edits(request)
        device = self.device(uuid)
        if device is None or not device.sm_partitions or self.partitions is None:
            return grant
        # the daemon runs with -S: the slice's compute is a partition of the instance's chunks
        chunks = chunks_for(request.plan.active_thread_percentage, device.sm_count, device.compute_capability)
        env = dict(grant.env)
        env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
        env["CUDA_MPS_SM_PARTITION"] = self.partitions.ensure(request.key, uuid, chunks)
        return Grant(env, grant.mounts)

    def grant(self, request: SliceRequest) -> Grant:
        check_no_burst(request, BURST)
        return self.edits(request)

    def burst_problem(self) -> str:
        return BURST

    def release(self, key: str) -> None:
        if self.partitions is not None:
            self.partitions.release(key)

    def adopt(self, requests: Iterable[SliceRequest]) -> None:
        for request in requests:
            try:
                self.edits(request)  # the partitions of static instances, on the running daemon
            except BackendError as exc:
                log.warning("slice not adopted key=%s error=%s", request.key, exc)

    def enforcement(self, request: SliceRequest) -> str:
        return ("memory: MIG between instances, shim per container and MPS per client within one; "
                "compute: MIG between instances, client environment within one")


class Routed:
    """MIG requests to ``mig``, the others to ``node``."""

    def __init__(self, node: Backend, mig: MigBackend) -> None:
        self.node, self.mig = node, mig
        self.name = f"{node.name}+{mig.name}"

    def _for(self, request: SliceRequest) -> Backend:
        return self.mig if is_mig(request) else self.node

    def edits(self, request: SliceRequest) -> Grant:
        return self._for(request).edits(request)

    def grant(self, request: SliceRequest) -> Grant:
        return self._for(request).grant(request)

    def release(self, key: str) -> None:
        self.node.release(key)  # a key does not say which: both forget it
        self.mig.release(key)

    def adopt(self, requests: Iterable[SliceRequest]) -> None:
        requests = list(requests)
        self.node.adopt([r for r in requests if not is_mig(r)])
        self.mig.adopt([r for r in requests if is_mig(r)])

    def enforcement(self, request: SliceRequest) -> str:
        return self._for(request).enforcement(request)

    def burst_problem(self) -> str:
        """The whole GPUs' backend's: a request with burst on an instance is refused by MigBackend.grant."""
        return self.node.burst_problem()
