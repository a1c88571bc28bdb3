"""NVML inventory through pynvml: the GPUs, the MPS clients on them, the driver version.

The only module that talks to NVML. Every pynvml error is translated here into
:class:`mpsd.errors.InventoryError` naming the NVML call and NVML's message.

``library_path`` (config ``nvmlLibrary``) makes pynvml use that file instead of its own
search for ``libnvidia-ml.so.1``; tests point it at the fake in tests/fakes/. pynvml keeps one
loaded library per process, so one process uses one NVML library at a time.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pynvml

from ..errors import InventoryError
from .mig import (CAPS_FILE, GI_PROFILE_COUNT, GI_PROFILES, MIB, MigDevice, caps_minors, ci_share, profile_name,
                  read_caps)

log = logging.getLogger(__name__)

LIBRARY_NAME = "libnvidia-ml.so.1"
NEEDS_NVML = f"mpsd needs NVML ({LIBRARY_NAME}, installed with the NVIDIA driver)"

# Errors meaning "this driver or GPU does not offer the call": use the fallback.
_UNAVAILABLE = (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_NotSupported)

T = TypeVar("T")


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_total: int  # bytes
    memory_used: int  # bytes
    compute_capability: tuple[int, int]
    mig_enabled: bool
    minor_number: int | None = None  # of /dev/nvidia<minor>; None where NVML cannot tell


@dataclass(frozen=True)
class Client:
    """A process with a CUDA context on a GPU; pids are host pids."""

    gpu_index: int
    pid: int
    used_memory: int | None  # bytes; None where NVML cannot tell


def use_library(path: str) -> None:
    """Make pynvml use the NVML library at ``path`` (before nvmlInit).

    pynvml loads ``libnvidia-ml.so.1`` by name into its module global ``nvmlLib`` and caches
    function pointers by name; setting the global and clearing that cache is the supported
    way to point it elsewhere in current versions (checked here, tested in tests/inventory).
    """
    if not hasattr(pynvml, "nvmlLib") or not isinstance(getattr(pynvml, "_nvmlGetFunctionPointer_cache", None), dict):
        raise InventoryError(
            f"nvmlLibrary {path!r} cannot be used: this pynvml version ({getattr(pynvml, '__file__', '?')}) "
            "has no nvmlLib/_nvmlGetFunctionPointer_cache; leave nvmlLibrary unset to use the loader path"
        )
    current = pynvml.nvmlLib
    if current is not None and getattr(current, "_name", None) == path:
        return
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise InventoryError(f"cannot load NVML library {path!r} ({e}); {NEEDS_NVML}") from e
    with pynvml.libLoadLock:
        pynvml.nvmlLib = lib
        pynvml._nvmlGetFunctionPointer_cache.clear()
    log.info("nvml library loaded path=%s", path)


def _call(what: str, fn: Callable[..., T], *args: object) -> T:
    """Run one pynvml call; NVML errors become InventoryError naming ``what``."""
    try:
        return fn(*args)
    except pynvml.NVMLError as e:
        raise InventoryError(f"NVML {what} failed: {e}") from e


class Inventory:
    """An initialised NVML session. ``close()`` (or ``with``) ends it."""

    def __init__(self, library_path: str | None = None) -> None:
        if library_path:
            use_library(library_path)
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound as e:
            raise InventoryError(f"NVML library {LIBRARY_NAME} not found on the loader path; {NEEDS_NVML}") from e
        except pynvml.NVMLError as e:
            raise InventoryError(f"NVML nvmlInit failed: {e}") from e
        self._open = True
        self._mps_query_missing: str | None = None  # why the MPS process query is unavailable
        self._memory_v2 = hasattr(pynvml, "nvmlMemory_v2")  # older pynvml: the v1 call only
        self._refused: set[str] = set()  # privileged queries refused, said once each

    def close(self) -> None:
        if self._open:
            self._open = False
            _call("nvmlShutdown", pynvml.nvmlShutdown)

    def __enter__(self) -> Inventory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if not self._open:
            raise InventoryError("NVML inventory used after close()")

    def driver_version(self) -> str:
        self._check_open()
        return _call("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion)

    def _handles(self) -> list[object]:
        self._check_open()
        count = _call("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)
        return [_call(f"nvmlDeviceGetHandleByIndex({i})", pynvml.nvmlDeviceGetHandleByIndex, i) for i in range(count)]

    def gpus(self) -> list[Gpu]:
        return [self._gpu(i, handle) for i, handle in enumerate(self._handles())]

    def _gpu(self, index: int, handle: object) -> Gpu:
        mig = self._mig_enabled(index, handle)
        try:
            total, used = self._memory(index, handle)
        except InventoryError as exc:
            if not (mig and isinstance(exc.__cause__, pynvml.NVMLError_NoPermission)):
                raise
            self._refused_once("memory", index, exc)
            total, used = 0, 0  # per instance through its MIG handles (mig_devices)
        major, minor = _call(
            f"nvmlDeviceGetCudaComputeCapability(gpu {index})", pynvml.nvmlDeviceGetCudaComputeCapability, handle
        )
        return Gpu(
            index=index,
            uuid=_call(f"nvmlDeviceGetUUID(gpu {index})", pynvml.nvmlDeviceGetUUID, handle),
            name=_call(f"nvmlDeviceGetName(gpu {index})", pynvml.nvmlDeviceGetName, handle),
            memory_total=total,
            memory_used=used,
            compute_capability=(major, minor),
            mig_enabled=mig,
            minor_number=self._minor_number(index, handle),
        )

    def _refused_once(self, what: str, index: int, exc: Exception) -> None:
        """nvml.h: on a GPU in MIG mode aggregate data goes "only" to a caller "with appropriate
        privileges"; a container without them is refused. Said once per query and GPU."""
        if f"{what}:{index}" not in self._refused:
            self._refused.add(f"{what}:{index}")
            log.warning("NVML refused the %s query of GPU %s in MIG mode (%s): it is read per MIG instance; "
                        "NVIDIA_MIG_MONITOR_DEVICES=all with CAP_SYS_ADMIN gives the whole view (docs/mig.md)",
                        what, index, exc)

    @staticmethod
    def _minor_number(index: int, handle: object) -> int | None:
        """The driver's minor number of the GPU (its /dev/nvidia<N>; not the NVML index)."""
        try:
            return int(pynvml.nvmlDeviceGetMinorNumber(handle))
        except _UNAVAILABLE:
            return None
        except pynvml.NVMLError as e:
            raise InventoryError(f"NVML nvmlDeviceGetMinorNumber(gpu {index}) failed: {e}") from e

    def _memory(self, index: int, handle: object) -> tuple[int, int]:
        """(total, used) bytes: _v2 (used excludes driver-reserved memory), else the v1 call."""
        if self._memory_v2:
            try:
                info = pynvml.nvmlDeviceGetMemoryInfo(handle, pynvml.nvmlMemory_v2)
                return int(info.total), int(info.used)
            except (*_UNAVAILABLE, pynvml.NVMLError_ArgumentVersionMismatch) as e:
                log.info("nvml memory query falling back to v1 gpu=%s reason=%r", index, str(e))
                self._memory_v2 = False
            except pynvml.NVMLError as e:
                raise InventoryError(f"NVML nvmlDeviceGetMemoryInfo_v2(gpu {index}) failed: {e}") from e
        info = _call(f"nvmlDeviceGetMemoryInfo(gpu {index})", pynvml.nvmlDeviceGetMemoryInfo, handle)
        return int(info.total), int(info.used)

    @staticmethod
    def _mig_enabled(index: int, handle: object) -> bool:
        try:
            current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        except _UNAVAILABLE:
            return False  # GPUs before Ampere have no MIG
        except pynvml.NVMLError as e:
            raise InventoryError(f"NVML nvmlDeviceGetMigMode(gpu {index}) failed: {e}") from e
        return current == pynvml.NVML_DEVICE_MIG_ENABLE

    def mig_devices(self, gpus: list[Gpu] | None = None, caps_file: str = CAPS_FILE) -> list[MigDevice]:
        """The MIG devices (compute instances) of every GPU in MIG mode, read now: the layout
        changes under a running mpsd (the MIG manager). An instance that vanishes while it is
        read is left out (the next round sees the new layout); any other NVML error is an
        InventoryError. ``gpus``: this round's listing (read again when None)."""
        listed = {g.index: g for g in (self.gpus() if gpus is None else gpus)}
        handles = self._handles()
        caps = read_caps(caps_file) if any(g.mig_enabled for g in listed.values()) else {}
        found: list[MigDevice] = []
        for index, gpu in sorted(listed.items()):
            if gpu.mig_enabled and index < len(handles):
                found += self._mig_of(gpu, handles[index], caps)
        return found

    def _mig_of(self, gpu: Gpu, handle: object, caps: dict) -> list[MigDevice]:
        where = f"gpu {gpu.index}"
        count = _call(f"nvmlDeviceGetMaxMigDeviceCount({where})", pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)
        try:
            minor: int | None = int(pynvml.nvmlDeviceGetMinorNumber(handle))
        except pynvml.NVMLError:
            minor = None  # device nodes are then the container runtime's to find
        profiles = self._gi_profiles(gpu, handle)
        out = []
        for slot in range(count):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                out.append(self._mig_device(gpu, slot, mig, minor, caps, handle, profiles))
            except (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument):
                continue  # no instance at this index, or it was destroyed while read
            except pynvml.NVMLError as e:
                raise InventoryError(f"NVML MIG device {slot} of {where} failed: {e}") from e
        return out

    @staticmethod
    def _gi_profiles(gpu: Gpu, handle: object) -> dict[int, object]:
        """The GPU instance profiles the GPU supports (nvmlDeviceGetGpuInstanceProfileInfo answers
        every caller), by NVML_GPU_INSTANCE_PROFILE_* ID."""
        found = {}
        for pid in range(GI_PROFILE_COUNT):
            try:
                found[pid] = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, pid, 1)
            except (*_UNAVAILABLE, pynvml.NVMLError_InvalidArgument):
                continue
            except pynvml.NVMLError as e:
                raise InventoryError(f"NVML nvmlDeviceGetGpuInstanceProfileInfo(gpu {gpu.index}, {pid}) "
                                     f"failed: {e}") from e
        return found

    def _gpu_instance(self, gpu: Gpu, handle: object, gi: int, attrs, profiles: dict) -> tuple[int | None, int | None]:
        """(GPU instance profile ID, placement start) of GPU instance ``gi``: from the instance itself
        where NVML lets this caller read it ("Requires privileged user"), else the one profile the
        GPU supports whose slices, memory and engines are the instance's (no placement then)."""
        try:
            info = pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceGetGpuInstanceById(handle, gi))
            return int(info.profileId), int(info.placement.start)
        except (*_UNAVAILABLE, pynvml.NVMLError_NoPermission) as exc:
            self._refused_once("GPU instance", gpu.index, exc)
        mine = (int(attrs.gpuInstanceSliceCount), int(attrs.memorySizeMB), int(attrs.sharedCopyEngineCount),
                int(attrs.sharedDecoderCount), int(attrs.sharedEncoderCount), int(attrs.sharedJpegCount),
                int(attrs.sharedOfaCount))
        matches = sorted(pid for pid, p in profiles.items()
                         if (p.sliceCount, p.memorySizeMB, p.copyEngineCount, p.decoderCount, p.encoderCount,
                             p.jpegCount, p.ofaCount) == mine)
        names = {GI_PROFILES.get(pid, (0, f"?{pid}"))[1] for pid in matches}
        return (matches[0] if len(names) == 1 else None), None

    def _mig_device(self, gpu: Gpu, slot: int, mig: object, minor: int | None, caps: dict, parent: object,
                    profiles: dict) -> MigDevice:
        attrs = pynvml.nvmlDeviceGetAttributes(mig)
        gi, ci = int(pynvml.nvmlDeviceGetGpuInstanceId(mig)), int(pynvml.nvmlDeviceGetComputeInstanceId(mig))
        memory = pynvml.nvmlDeviceGetMemoryInfo(mig)  # its GPU instance's, shared by its compute instances
        gip, start = self._gpu_instance(gpu, parent, gi, attrs, profiles)
        gi_slices, ci_slices = int(attrs.gpuInstanceSliceCount), int(attrs.computeInstanceSliceCount)
        # go-nvlib rounds against the parent's memory; without privileges, the largest profile's
        gpu_total = gpu.memory_total or max((int(p.memorySizeMB) for p in profiles.values()), default=0) * MIB
        profile = profile_name(gip, ci_slices, int(attrs.memorySizeMB), gpu_total)
        uuid = pynvml.nvmlDeviceGetUUID(mig)
        return MigDevice(
            uuid=uuid, parent_index=gpu.index, parent_uuid=gpu.uuid, mig_index=slot,
            gpu_instance=gi, compute_instance=ci,
            profile=profile or "",
            name=pynvml.nvmlDeviceGetName(mig), memory_total=ci_share(int(memory.total), ci_slices, gi_slices),
            memory_used=int(memory.used), sm_count=int(attrs.multiprocessorCount), gi_slices=gi_slices,
            ci_slices=ci_slices, compute_capability=gpu.compute_capability,
            parent_minor=minor, caps_minors=caps_minors(caps, minor, gi, ci), gi_profile_id=gip,
            placement_start=start, parent_name=gpu.name, gi_memory=int(memory.total),
            engines=(int(attrs.sharedCopyEngineCount), int(attrs.sharedDecoderCount), int(attrs.sharedEncoderCount),
                     int(attrs.sharedJpegCount), int(attrs.sharedOfaCount)),
            problem="" if profile else (f"its GPU instance profile is not one mpsd knows (ID {gip}; slices, memory "
                                        "and engines match no single profile the GPU lists)"),
        )

    def mps_clients(self) -> list[Client]:
        """MPS client processes per GPU, from the MPS process query. Where the driver lacks
        it, the plain compute-process query instead (it shows the MPS server, not the
        clients); the switch is logged once."""
        clients: list[Client] = []
        for index, handle in enumerate(self._handles()):
            try:
                found = self._processes(index, handle)
            except InventoryError as exc:
                if not (isinstance(exc.__cause__, pynvml.NVMLError_NoPermission) and self._mig_enabled(index, handle)):
                    raise
                self._refused_once("process", index, exc)  # a GPU in MIG mode, unprivileged
                continue
            clients += [Client(index, int(p.pid), p.usedGpuMemory) for p in found]
        return clients

    def _processes(self, index: int, handle: object) -> list:
        query = getattr(pynvml, "nvmlDeviceGetMPSComputeRunningProcesses_v3", None)
        if self._mps_query_missing is None and query is None:
            self._fall_back(index, "pynvml has no nvmlDeviceGetMPSComputeRunningProcesses_v3")
        if self._mps_query_missing is None and query is not None:
            try:
                return query(handle)
            except _UNAVAILABLE as e:
                self._fall_back(index, str(e))
            except pynvml.NVMLError as e:
                raise InventoryError(f"NVML nvmlDeviceGetMPSComputeRunningProcesses_v3(gpu {index}) failed: {e}") from e
        return _call(
            f"nvmlDeviceGetComputeRunningProcesses_v3(gpu {index})",
            pynvml.nvmlDeviceGetComputeRunningProcesses_v3,
            handle,
        )

    def _fall_back(self, index: int, reason: str) -> None:
        self._mps_query_missing = reason
        log.warning(
            "nvml MPS process query unavailable, using compute processes (MPS clients show as the server) "
            "gpu=%s reason=%r",
            index,
            reason,
        )


# ---------------------------------------------------------------- memory limits by cgroup (R615+)


def _handle(index: int) -> object:
    return _call(f"nvmlDeviceGetHandleByIndex({index})", pynvml.nvmlDeviceGetHandleByIndex, index)


def memory_limits(index: int, cgroup: str) -> tuple[int, int, int]:
    """(soft, hard, used) bytes of ``cgroup`` on GPU ``index`` (nvmlDeviceGetMemoryLimits_v1; no
    limit reads soft 0, hard NVML_DEVICE_MEMORY_LIMIT_MAX). InventoryError names the call."""
    limits = pynvml.c_nvmlGetMemoryLimits_v1_t()
    limits.nameSpace = cgroup.encode()
    _call(f"nvmlDeviceGetMemoryLimits_v1(gpu {index}, {cgroup})", pynvml.nvmlDeviceGetMemoryLimits_v1,
          _handle(index), limits)
    return int(limits.softLimit), int(limits.hardLimit), int(limits.currentUsed)


def set_memory_limits(index: int, cgroup: str, soft: int, hard: int) -> None:
    """nvmlDeviceSetMemoryLimits_v1 (root only; soft 0 and hard NO_LIMIT clear them)."""
    limits = pynvml.c_nvmlSetMemoryLimits_v1_t()
    limits.nameSpace = cgroup.encode()
    limits.softLimit, limits.hardLimit = soft, hard
    _call(f"nvmlDeviceSetMemoryLimits_v1(gpu {index}, {cgroup}, soft {soft}, hard {hard})",
          pynvml.nvmlDeviceSetMemoryLimits_v1, _handle(index), limits)


NO_LIMIT = getattr(pynvml, "NVML_DEVICE_MEMORY_LIMIT_MAX", (1 << 64) - 1)
UNAVAILABLE = _UNAVAILABLE
