"""The sharing backend: what "a slice of a device" becomes on this node.

The faces (the device plugin's Allocate, the DRA driver's Prepare, ``mpsd exec``) decide *how
much* a client gets; a backend decides *how* the node gives it. A face builds a
:class:`SliceRequest` and asks the node's backend; it gets a :class:`Grant` back (environment
and mounts, which the device plugin answers as they are and the DRA driver writes as CDI
edits). No face speaks MPS itself.

Interface (:class:`Backend`)::

    edits(request)   -> Grant  pure: what the container gets (a prepared claim's CDI spec is
                               compared with it after a restart)
    grant(request)   -> Grant  create what the slice needs on the node (idempotent: a kubelet
                               retry, a restart), then edits(request); BackendError (one line)
                               when the backend cannot give it
    release(key)               undo grant (idempotent; an unknown key is fine)
    adopt(requests)            the slices a restarted face still holds, from its journal:
                               the backend re-creates what they need
    enforcement(request) -> str  one line: what enforces this slice's memory and compute
    burst_problem()  -> str    "" where a hard limit above the guarantee (burst) can be
                               enforced, else why not (requests with one are then refused)

Devices stay abstract: a request names devices by UUID with the host index and the bytes
they stand for (mpsd.alloc.slicing.GpuShare); a whole GPU today, a MIG instance (its own
UUID) on the same seam later. Backends:

- ``mps-v2`` (mpsd/sharing/v2.py): one node-wide MPS daemon; per-client limits in the
  environment (CUDA_MPS_*), the shim for the per-container cap. Today's behaviour.
- ``mps-v3`` (mpsd/sharing/v3.py): one server per GPU, one namespace per slice carrying its
  memory, compute and priority; memory enforced by the driver per cgroup where it can
  (mpsd/sharing/memory.py), the shim where it cannot.

Which one a node uses is decided once at start (mpsd/sharing/detect.py, config ``mps.protocol``;
mpsd/sharing/build.py builds it). Below the faces and the lifecycle: may import mpsd.alloc,
mpsd.daemon, mpsd.inventory, mpsd.config and the base modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Protocol

from ..alloc.container import Mount
from ..alloc.shimfile import SHIM_NAME

if TYPE_CHECKING:
    from ..alloc.slicing import Plan


@dataclass(frozen=True)
class SliceRequest:
    """One slice as a face asks for it. ``key`` names it for the backend (an allocation ID,
    ``claim-<uid>``, ``exec-<pid>``): the same key is the same slice."""

    key: str
    plan: Plan  # devices (GpuShare: ordinal, host index, UUID, guaranteed bytes) and compute
    region_dir: str  # host: the slice's own allocation directory (the shim's region)
    client_priority: int | None = None
    memory_hard: dict[int, int] = field(default_factory=dict)  # ordinal -> hard bytes above the guarantee
    pod_uids: tuple[str, ...] = ()  # pods known to hold it (DRA: reservedFor); () when unknown
    shim: str = SHIM_NAME  # the shim file its containers preload (mpsd/alloc/shimfile.py)

    def hard_limit(self, ordinal: int) -> int:
        """The hard limit on a device: the burst limit when one is set, else its guarantee."""
        share = next(g for g in self.plan.gpus if g.ordinal == ordinal)
        return max(self.memory_hard.get(ordinal, 0), share.memory_limit)


@dataclass(frozen=True)
class Grant:
    env: dict[str, str]
    mounts: tuple[Mount, ...]


class Backend(Protocol):
    name: str

    def edits(self, request: SliceRequest) -> Grant: ...

    def grant(self, request: SliceRequest) -> Grant: ...

    def release(self, key: str) -> None: ...

    def adopt(self, requests: Iterable[SliceRequest]) -> None: ...

    def enforcement(self, request: SliceRequest) -> str: ...

    def burst_problem(self) -> str: ...
