"""Reading a container's accounting region through libmpsshim.so (cffi, ABI mode).

The library exports ``int mpsshim_usage(const char *path, ms_snapshot *out, char *err,
size_t errlen)``; ``ms_snapshot`` is declared in csrc/region.h and mirrored in CDEF below
(tests/e2e/test_shim_package.py compares sizes and offsets with a C compiler's).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._errors import RegionError, ShimError
from ._library import library_path

log = logging.getLogger(__name__)

MAX_DEVICES = 64  # MS_MAX_DEVICES, csrc/limits.h
MAX_PROCS = 256  # MS_SNAPSHOT_MAX_PROCS, csrc/region.h
ERR_LEN = 512

CDEF = f"""
typedef struct ms_proc_usage {{
    int32_t pid;
    int32_t alive;
    uint64_t used[{MAX_DEVICES}];
}} ms_proc_usage;

typedef struct ms_snapshot {{
    uint32_t version;
    uint32_t nprocs;
    uint64_t cap[{MAX_DEVICES}];
    uint64_t used[{MAX_DEVICES}];
    ms_proc_usage procs[{MAX_PROCS}];
}} ms_snapshot;

int mpsshim_usage(const char *path, ms_snapshot *out, char *err, size_t errlen);
"""


@dataclass(frozen=True)
class ProcessUsage:
    pid: int
    alive: bool
    used: int  # bytes this process holds on the device


@dataclass(frozen=True)
class DeviceUsage:
    device: int
    cap: int  # bytes; 0 = no cap seen on this device
    used: int  # bytes in use by all processes sharing the region
    processes: list[ProcessUsage] = field(default_factory=list)


@dataclass(frozen=True)
class RawProcess:
    pid: int
    alive: bool
    used: Sequence[int]  # per device


def devices_from_snapshot(caps: Sequence[int], used: Sequence[int], procs: Sequence[RawProcess]) -> list[DeviceUsage]:
    """The devices worth showing (a cap, usage, or a process holding memory there), in order,
    each with the processes holding memory on it."""
    devices = []
    for dev in range(len(caps)):
        holders = [ProcessUsage(p.pid, p.alive, p.used[dev]) for p in procs if p.used[dev] > 0]
        if caps[dev] or used[dev] or holders:
            devices.append(DeviceUsage(dev, caps[dev], used[dev], holders))
    return devices


@functools.lru_cache(maxsize=4)
def _load(path: str) -> tuple[Any, Any]:
    import cffi  # the only module here that needs it

    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    try:
        lib = ffi.dlopen(path)
        lib.mpsshim_usage  # noqa: B018 - resolve now, fail here if the export is missing
    except (OSError, AttributeError) as exc:
        raise ShimError(f"cannot use {path} to read regions: {exc}") from exc
    return ffi, lib


def usage(region_path: str | os.PathLike[str], library: str | os.PathLike[str] | None = None) -> list[DeviceUsage]:
    """Per device: cap, bytes in use and the processes holding them, read from the region file
    that a container's processes share (their MPSSHIM_REGION). Read-only: claims no slot."""
    path = Path(region_path)
    lib_path = str(library) if library is not None else str(library_path())
    ffi, lib = _load(lib_path)
    snap = ffi.new("ms_snapshot *")
    err = ffi.new("char[]", ERR_LEN)
    if lib.mpsshim_usage(os.fsencode(path), snap, err, ERR_LEN) != 0:
        reason = ffi.string(err).decode(errors="replace") or "unknown error"
        raise RegionError(f"cannot read region {str(path)!r}: {reason}")
    nprocs = min(int(snap.nprocs), MAX_PROCS)
    procs = [RawProcess(int(p.pid), bool(p.alive), list(p.used)) for p in (snap.procs[i] for i in range(nprocs))]
    devices = devices_from_snapshot(list(snap.cap), list(snap.used), procs)
    log.debug("region read path=%s version=%d procs=%d devices=%d", path, snap.version, nprocs, len(devices))
    return devices
