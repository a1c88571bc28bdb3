"""Reading a container's accounting region through libmpsshim.so (cffi, ABI mode).

The library exports ``int mpsshim_usage(const char *path, ms_snapshot *out, char *err,
size_t errlen)`` and ``mpsshim_usage_fd(int fd, ...)`` (used here, on a file checked first, its
size against ``mpsshim_region_size()``);
a layout-2 file (the shim before reserves, in containers started before an mpsd upgrade) is
read too, its size checked against ``mpsshim_region_size_of(2)``;
``ms_snapshot`` is declared in csrc/region.h and mirrored in CDEF below
(tests/e2e/test_shim_package.py compares sizes and offsets with a C compiler's).
"""

from __future__ import annotations

import functools
import logging
import os
import stat
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
int mpsshim_usage_fd(int fd, int lock_fd, ms_snapshot *out, char *err, size_t errlen);
size_t mpsshim_region_size(void);
size_t mpsshim_region_size_of(uint32_t layout);
int mpsshim_layout(void);
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
        lib.mpsshim_usage_fd  # noqa: B018 - resolve now, fail here if the export is missing
        lib.mpsshim_region_size  # noqa: B018
    except (OSError, AttributeError) as exc:
        raise ShimError(f"cannot use {path} to read regions: {exc}") from exc
    return ffi, lib


MAX_REGION_BYTES = 64 << 20  # far above any layout's size (the library checks the exact one)


def open_region(path: str | os.PathLike[str]) -> int:
    """An O_PATH descriptor of the regular file at ``path``, whoever may write there (a pod owns
    its region's directory): a symlink as the last component is refused, not followed; a FIFO
    or device node is refused without being opened (an O_PATH open runs no driver and never
    blocks); a file larger than any region is refused. RegionError with one line otherwise."""
    name = repr(str(path))
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        reason = "missing" if isinstance(exc, FileNotFoundError) else "unreadable"
        raise RegionError(f"cannot read region {name}: {exc.strerror or exc}", reason) from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):
            raise RegionError(f"cannot read region {name}: it is a symbolic link (refused, not followed)",
                              "not_regular")
        if not stat.S_ISREG(st.st_mode):
            mode = stat.filemode(st.st_mode)
            raise RegionError(f"cannot read region {name}: not a regular file (mode {mode})", "not_regular")
        if st.st_size > MAX_REGION_BYTES:
            raise RegionError(f"cannot read region {name}: {st.st_size} bytes, no region is above {MAX_REGION_BYTES}",
                              "too_large")
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_layout(fd: int) -> int:
    """The layout version a region file's header names (bytes 8-11), 0 if it is shorter."""
    head = os.pread(fd, 12, 0)
    return int.from_bytes(head[8:12], "little") if len(head) == 12 else 0


def region_size(lib: Any, fd: int) -> int:
    """The size the library expects of the region file ``fd``: that of the layout its header names
    when the library reads that layout, else the library's own layout's (a library without
    mpsshim_region_size_of reads its own layout only)."""
    try:
        size = int(lib.mpsshim_region_size_of(file_layout(fd)))
    except AttributeError:
        size = 0
    return size or int(lib.mpsshim_region_size())


def layout(library: str | os.PathLike[str] | None = None) -> int:
    """The region layout ``library`` (default: library_path()) creates and charges."""
    lib_path = str(library) if library is not None else str(library_path())
    _, lib = _load(lib_path)
    try:
        return int(lib.mpsshim_layout())
    except AttributeError as exc:
        raise ShimError(f"{lib_path} exports no mpsshim_layout: a shim older than layout 3") from exc


def check_size(fd: int, path: str, size: int) -> None:
    """RegionError unless the open file ``fd`` is exactly ``size`` bytes (the library's
    layout): checked on the descriptor before a byte is copied, so that a file of any other
    size costs one fstat, not a copy of up to MAX_REGION_BYTES."""
    actual = os.fstat(fd).st_size
    if actual != size:
        raise RegionError(f"cannot read region {path!r}: region {path} is {actual} bytes, expected {size} "
                          "(truncated, or not this shim's layout)", "corrupted")


def private_copy(src: int, name: str) -> int:
    """A memfd holding the bytes of the checked file ``src``, read with pread: a writer that
    truncates the file meanwhile shortens the copy (refused later for its size), where it
    would have killed a reader of a shared mapping with SIGBUS."""
    chunks, total = [], 0
    while total <= MAX_REGION_BYTES:
        chunk = os.pread(src, 1 << 20, total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > MAX_REGION_BYTES:
        raise RegionError(f"cannot read region {name}: grew past {MAX_REGION_BYTES} bytes while read", "too_large")
    copy = os.memfd_create("mpsshim-region-copy", os.MFD_CLOEXEC)
    try:
        view = memoryview(b"".join(chunks))
        while view:
            view = view[os.write(copy, view):]
    except BaseException:
        os.close(copy)
        raise
    return copy


def usage(
    region_path: str | os.PathLike[str], library: str | os.PathLike[str] | None = None, *, copy: bool = False
) -> list[DeviceUsage]:
    """Per device: cap, bytes in use and the processes holding them, read from the region file
    that a container's processes share (their MPSSHIM_REGION). Read-only: claims no slot.

    The file is checked first (``open_region``) and the library reads that very file (opened
    again through /proc/self/fd, handed over as a descriptor), so a name swapped after the check
    (a FIFO, a symlink) is never opened.
    ``copy``: read a private copy instead of mapping the file, for a long-lived reader of files
    others can truncate (mpsd itself: the device plugin, the exec regions' metrics): no SIGBUS;
    whether a process is alive is still tested on the file itself."""
    path = Path(region_path)
    lib_path = str(library) if library is not None else str(library_path())
    ffi, lib = _load(lib_path)
    snap = ffi.new("ms_snapshot *")
    err = ffi.new("char[]", ERR_LEN)
    held = open_region(path)
    try:  # the checked regular file itself: opening it cannot block or run a driver
        live = os.open(f"/proc/self/fd/{held}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    finally:
        os.close(held)
    try:
        check_size(live, str(path), region_size(lib, live))
        fd = private_copy(live, repr(str(path))) if copy else live
        try:
            if lib.mpsshim_usage_fd(fd, live, snap, err, ERR_LEN) != 0:
                reason = ffi.string(err).decode(errors="replace").replace(f"/proc/self/fd/{fd}", str(path))
                raise RegionError(f"cannot read region {str(path)!r}: {reason or 'unknown error'}", "corrupted")
        finally:
            if fd != live:
                os.close(fd)
    finally:
        os.close(live)
    nprocs = min(int(snap.nprocs), MAX_PROCS)
    procs = [RawProcess(int(p.pid), bool(p.alive), list(p.used)) for p in (snap.procs[i] for i in range(nprocs))]
    devices = devices_from_snapshot(list(snap.cap), list(snap.used), procs)
    log.debug("region read path=%s version=%d procs=%d devices=%d", path, snap.version, nprocs, len(devices))
    return devices
