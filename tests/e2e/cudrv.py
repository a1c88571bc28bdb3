"""A ctypes client of the CUDA driver API, loading it the way CuPy and numba do:
``ctypes.CDLL("libcuda.so.1")`` (dlopen) and one ``getattr`` (dlsym on that handle) per
function, preferring the ``_v2`` names. Run in a child process by the end-to-end tests, with the
fake driver on LD_LIBRARY_PATH and, when a test wants it, the shim in LD_PRELOAD.

Only what the tests need; every call raises CudaError on a non-zero result.
"""
from __future__ import annotations

import ctypes
import json
import sys
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_ulonglong, c_void_p
from typing import Any

OUT_OF_MEMORY = 2
INVALID_VALUE = 1
NOT_INITIALIZED = 3
INVALID_CONTEXT = 201


class CudaError(Exception):
    def __init__(self, func: str, code: int) -> None:
        super().__init__(f"{func} returned {code}")
        self.func = func
        self.code = code


class MemAllocationProp(ctypes.Structure):
    """CUmemAllocationProp (x86-64 layout: location.type at 8, location.id at 12, size 32)."""

    _fields_ = [
        ("type", c_int),
        ("requestedHandleTypes", c_int),
        ("location_type", c_int),
        ("location_id", c_int),
        ("win32HandleMetaData", c_void_p),
        ("allocFlags", ctypes.c_ubyte * 8),
    ]


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", c_char_p), ("dli_fbase", c_void_p), ("dli_sname", c_char_p), ("dli_saddr", c_void_p)]


_libc = ctypes.CDLL(None)
_libc.dladdr.argtypes = [c_void_p, POINTER(_DlInfo)]


class Driver:
    def __init__(self, name: str = "libcuda.so.1") -> None:
        self.lib = ctypes.CDLL(name)

    def fn(self, name: str) -> Any:
        """The function as a dlsym on the driver's handle would find it."""
        return getattr(self.lib, name)

    def call(self, name: str, *args: Any) -> None:
        rc = self.fn(name)(*args)
        if rc != 0:
            raise CudaError(name, rc)

    # --- setup ---
    def init(self, device: int = 0) -> None:
        """cuInit, then make the device's primary context current on this thread."""
        self.call("cuInit", 0)
        self.set_device(device)

    def set_device(self, device: int) -> None:
        ctx = c_void_p()
        self.call("cuDevicePrimaryCtxRetain", byref(ctx), device)
        self.call("cuCtxSetCurrent", ctx)

    def device_count(self) -> int:
        n = c_int()
        self.call("cuDeviceGetCount", byref(n))
        return n.value

    # --- memory ---
    def alloc(self, size: int) -> int:
        ptr = c_ulonglong()
        self.call("cuMemAlloc_v2", byref(ptr), c_size_t(size))
        return ptr.value

    def free(self, ptr: int) -> None:
        self.call("cuMemFree_v2", c_ulonglong(ptr))

    def alloc_pitch(self, width: int, height: int, elem: int = 4) -> tuple[int, int]:
        ptr, pitch = c_ulonglong(), c_size_t()
        self.call("cuMemAllocPitch_v2", byref(ptr), byref(pitch), c_size_t(width), c_size_t(height), c_uint(elem))
        return ptr.value, pitch.value

    def alloc_managed(self, size: int) -> int:
        ptr = c_ulonglong()
        self.call("cuMemAllocManaged", byref(ptr), c_size_t(size), c_uint(1))
        return ptr.value

    def stream_create(self) -> int:
        stream = c_void_p()
        self.call("cuStreamCreate", byref(stream), c_uint(0))
        return stream.value or 0

    def alloc_async(self, size: int, stream: int = 0, ptsz: bool = False) -> int:
        ptr = c_ulonglong()
        self.call("cuMemAllocAsync_ptsz" if ptsz else "cuMemAllocAsync", byref(ptr), c_size_t(size), c_void_p(stream))
        return ptr.value

    def free_async(self, ptr: int, stream: int = 0, ptsz: bool = False) -> None:
        self.call("cuMemFreeAsync_ptsz" if ptsz else "cuMemFreeAsync", c_ulonglong(ptr), c_void_p(stream))

    def pool_create(self, device: int) -> int:
        props = (ctypes.c_ubyte * 88)()  # CUmemPoolProps: location.type at 8, location.id at 12
        ctypes.memmove(ctypes.addressof(props) + 8, (c_int * 2)(1, device), 8)
        pool = c_void_p()
        self.call("cuMemPoolCreate", byref(pool), props)
        return pool.value or 0

    def default_pool(self, device: int) -> int:
        pool = c_void_p()
        self.call("cuDeviceGetDefaultMemPool", byref(pool), device)
        return pool.value or 0

    def alloc_from_pool(self, size: int, pool: int, stream: int = 0, ptsz: bool = False) -> int:
        ptr = c_ulonglong()
        name = "cuMemAllocFromPoolAsync_ptsz" if ptsz else "cuMemAllocFromPoolAsync"
        self.call(name, byref(ptr), c_size_t(size), c_void_p(pool), c_void_p(stream))
        return ptr.value

    def mem_create(self, size: int, device: int) -> int:
        prop = MemAllocationProp(type=1, location_type=1, location_id=device)
        handle = c_ulonglong()
        self.call("cuMemCreate", byref(handle), c_size_t(size), byref(prop), c_ulonglong(0))
        return handle.value

    def mem_release(self, handle: int) -> None:
        self.call("cuMemRelease", c_ulonglong(handle))

    def mem_map(self, va: int, size: int, handle: int) -> None:
        self.call("cuMemMap", c_ulonglong(va), c_size_t(size), c_size_t(0), c_ulonglong(handle), c_ulonglong(0))

    def mem_unmap(self, va: int, size: int) -> None:
        self.call("cuMemUnmap", c_ulonglong(va), c_size_t(size))

    def mem_retain(self, va: int) -> int:
        handle = c_ulonglong()
        self.call("cuMemRetainAllocationHandle", byref(handle), c_void_p(va))
        return handle.value

    def mem_info(self) -> tuple[int, int]:
        free, total = c_size_t(), c_size_t()
        self.call("cuMemGetInfo_v2", byref(free), byref(total))
        return free.value, total.value

    def total_mem(self, device: int) -> int:
        total = c_size_t()
        self.call("cuDeviceTotalMem_v2", byref(total), device)
        return total.value

    # --- cuGetProcAddress ---
    def proc_address(self, symbol: str, version: int, flags: int = 0) -> tuple[int | None, int]:
        """(pointer or None, symbolStatus) from cuGetProcAddress_v2."""
        pfn, status = c_void_p(), c_int(-1)
        f = self.fn("cuGetProcAddress_v2")
        f.argtypes = [c_char_p, POINTER(c_void_p), c_int, c_ulonglong, POINTER(c_int)]
        rc = f(symbol.encode(), byref(pfn), version, flags, byref(status))
        if rc != 0:
            raise CudaError("cuGetProcAddress_v2", rc)
        return pfn.value, status.value

    def address_of(self, name: str) -> int:
        """The address dlsym gives for an exported name."""
        return ctypes.cast(self.fn(name), c_void_p).value or 0

    @staticmethod
    def library_of(address: int) -> str:
        """The file name of the shared object holding an address (dladdr)."""
        info = _DlInfo()
        if not _libc.dladdr(c_void_p(address), byref(info)):
            return ""
        return (info.dli_fname or b"").decode()

    # --- probes of the fake driver (never present in a real one) ---
    def fake_used(self, device: int = 0) -> int:
        f = self.fn("fakecuda_used")
        f.restype = c_ulonglong
        return int(f(device))

    def fake_calls(self, name: str) -> int:
        f = self.fn("fakecuda_calls")
        f.restype = c_ulonglong
        f.argtypes = [c_char_p]
        return int(f(name.encode()))


def emit(**values: Any) -> None:
    """Report results to the parent test as one JSON line on stdout."""
    sys.stdout.write(json.dumps(values) + "\n")
    sys.stdout.flush()


def attempt(func: Any, *args: Any) -> Any:
    """The function's result, or the CUDA error code it raised (as {"error": code})."""
    try:
        return func(*args)
    except CudaError as exc:
        return {"error": exc.code}


__all__ = ["Driver", "CudaError", "emit", "attempt", "c_uint", "c_int", "c_void_p", "c_ulonglong", "byref"]
