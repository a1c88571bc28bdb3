"""GPU memory limited by the driver per cgroup (MPS v3 memory partitioning, driver R615+).

NVIDIA's "MPS v3 Memory Partitioning" page: a cgroup's hard limit (``dmem.max`` under the
kernel's dmem controller, an internal backend before 6.14) fails allocations beyond it; its
soft limit (``dmem.min``) is guaranteed, and above it a client borrows and may be evicted under
pressure. It counts all device memory of the cgroup (no LD_PRELOAD to skip) and memory queries
inside the cgroup report the limit. It needs cgroup v2, CUDA 13.4+ and a non-MIG device; NVML's
``nvmlDevice{Set,Get}MemoryLimits_v1`` (mpsd/inventory/nvml.py) set and read it, as root.

Which cgroup, and when it is known (docs/mps-v3.md):

- a DRA claim: its pods' UIDs are in the claim (``status.reservedFor``), and the kubelet creates
  a pod's cgroup before it prepares the pod's claims (kuberuntime_manager.go: SyncPod calls
  PrepareDynamicResources before createPodSandbox; the pod cgroup is made earlier in
  kubelet.go's SyncPod): the limit is set on the pod's cgroup at Prepare, before any container;
- a device-plugin allocation: Allocate names only device IDs; the container's cgroup is known
  once one of its processes is an MPS client of the allocation's namespace (``client list
  --all``, then /proc/PID/cgroup): the limit follows at the next memory round. Until then the
  namespace's limit (per client) and the shim hold.

Every round reads the limits back and restores any that changed (drift); release clears them
(a cgroup removed with its pod has cleared them already: "removing the cgroup will also clear
any limits").
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Iterable

from ..errors import BackendError, InventoryError

log = logging.getLogger(__name__)

QOS = ("", "burstable", "besteffort")


def pod_cgroup_candidates(root: str, uid: str) -> list[str]:
    """Where the kubelet puts a pod's cgroup (cgroupfs and systemd drivers, each QoS class)."""
    under = uid.replace("-", "_")
    out = []
    for qos in QOS:
        cgroupfs = ("kubepods", qos) if qos else ("kubepods",)
        out.append(os.path.join(root, *cgroupfs, f"pod{uid}"))
        if qos:
            slice_dir = os.path.join(root, "kubepods.slice", f"kubepods-{qos}.slice")
            out.append(os.path.join(slice_dir, f"kubepods-{qos}-pod{under}.slice"))
        else:
            out.append(os.path.join(root, "kubepods.slice", f"kubepods-pod{under}.slice"))
    return [os.path.normpath(p) for p in out]


def find_pod_cgroup(root: str, uid: str) -> str | None:
    for path in pod_cgroup_candidates(root, uid):
        if os.path.isdir(path) and not os.path.islink(path):
            return path
    return None


def cgroup_v2_path(text: str) -> str | None:
    """The unified hierarchy's path from /proc/PID/cgroup (the ``0::/...`` line)."""
    for line in text.splitlines():
        if line.startswith("0::"):
            path = line[3:].strip()
            return path if path.startswith("/") and ".." not in path.split("/") else None
    return None


def cgroup_of(pid: int, root: str, proc: str = "/proc") -> str | None:
    try:
        fd = os.open(f"{proc}/{pid}/cgroup", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            text = os.read(fd, 65536).decode(errors="replace")
        finally:
            os.close(fd)
    except OSError:
        return None
    path = cgroup_v2_path(text)
    return None if path is None else os.path.normpath(root + path)


Target = tuple[str, int, int, int]  # (cgroup, GPU index, soft, hard)


class CgroupLimits:
    """The limits mpsd set, by slice key; set, read back, restored and cleared through ``nvml``
    (an object with memory_limits, set_memory_limits and NO_LIMIT: mpsd/inventory/nvml.py)."""

    def __init__(self, nvml, root: str) -> None:
        self.nvml = nvml
        self.root = root
        self.restored = 0  # limits found changed and put back
        self._lock = threading.Lock()
        self._applied: dict[str, set[tuple[str, int]]] = {}

    def available(self, indices: Iterable[int], mig: Callable[[int], bool] = lambda i: False) -> str:
        """"" when the driver limits memory by cgroup on every one of these GPUs, else why not."""
        if not os.path.isfile(os.path.join(self.root, "cgroup.controllers")):
            return f"{self.root} is not a cgroup v2 mount"
        for index in indices:
            if mig(index):
                return f"GPU {index} is in MIG mode (memory partitioning is not for MIG)"
            try:
                self.nvml.memory_limits(index, self.root)
            except InventoryError as exc:
                return f"the driver does not limit memory by cgroup on GPU {index}: {exc}"
        return ""

    def apply(self, key: str, targets: Iterable[Target]) -> list[str]:
        """Set and read back each target's limits (those that read back as wanted are left
        alone); notes of what was set or restored. BackendError when the driver refuses one."""
        notes = []
        for cgroup, index, soft, hard in targets:
            try:
                got = self.nvml.memory_limits(index, cgroup)[:2]
                if got != (soft, hard):
                    self.nvml.set_memory_limits(index, cgroup, soft, hard)
                    got2 = self.nvml.memory_limits(index, cgroup)[:2]
                    if got2 != (soft, hard):
                        raise BackendError(f"{key}: GPU {index} cgroup {cgroup}: set soft {soft} hard {hard}, "
                                           f"the driver reads back soft {got2[0]} hard {got2[1]}")
                    known = (cgroup, index) in self._applied.get(key, set())
                    notes.append(f"{cgroup} GPU {index} {'restored from' if known else 'set, was'} soft {got[0]} "
                                 f"hard {got[1]}")
                    if known:
                        self.restored += 1
            except InventoryError as exc:
                raise BackendError(f"{key}: memory limit of GPU {index} on {cgroup} refused: {exc}") from exc
            with self._lock:
                self._applied.setdefault(key, set()).add((cgroup, index))
        return notes

    def release(self, key: str) -> None:
        with self._lock:
            applied = self._applied.pop(key, set())
        for cgroup, index in sorted(applied):
            try:
                self.nvml.set_memory_limits(index, cgroup, 0, self.nvml.NO_LIMIT)
            except InventoryError as exc:  # a cgroup removed with its pod has no limits left
                log.info("memory limits not cleared key=%s cgroup=%s gpu=%d (%s)", key, cgroup, index, exc)

    def applied(self, key: str) -> set[tuple[str, int]]:
        with self._lock:
            return set(self._applied.get(key, set()))


class NvmlLimits:
    """mpsd/inventory/nvml.py's module functions as the object CgroupLimits calls."""

    def __init__(self) -> None:
        from ..inventory import nvml as inventory

        self.memory_limits = inventory.memory_limits
        self.set_memory_limits = inventory.set_memory_limits
        self.NO_LIMIT = inventory.NO_LIMIT

