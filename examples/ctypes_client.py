#!/usr/bin/env python3
"""A CUDA driver-API client with nothing but ctypes: what a process sees under an mpsd slice.

It loads libcuda.so.1 the way CuPy and numba do (dlopen + dlsym), asks every device for its
total and free memory, and optionally allocates, so you can watch the slice's cap at work:

    python examples/ctypes_client.py                    # memory as the process sees it
    python examples/ctypes_client.py --allocate 6G      # try one allocation on device 0
    mpsd exec --gpu-memory 4G -- python examples/ctypes_client.py --allocate 6G

Under the shim (LD_PRELOAD=libmpsshim.so with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) total and
free are the slice's, and an allocation past it fails with CUDA_ERROR_OUT_OF_MEMORY (2).
Exit status: 0, or 3 when the requested allocation was refused. Needs only Python and a
driver (or tests/fakes' fake libcuda.so.1).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys

SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
OUT_OF_MEMORY = 2


def parse_size(text: str) -> int:
    """'512M', '6G', '1024' → bytes (binary suffixes, as MPS uses them)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)I?B?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected a number with an optional K, M, G or T suffix")
    return int(match.group(1)) * SUFFIX[match.group(2)]


class Driver:
    """The handful of driver entry points this example needs, with errors raised by name."""

    def __init__(self, path: str = "libcuda.so.1") -> None:
        self.lib = ctypes.CDLL(path)

    def call(self, name: str, *args: object) -> int:
        return int(getattr(self.lib, name)(*args))

    def check(self, name: str, *args: object) -> None:
        rc = self.call(name, *args)
        if rc != 0:
            raise RuntimeError(f"{name} failed: {self.error_name(rc)} ({rc})")

    def error_name(self, rc: int) -> str:
        text = ctypes.c_char_p()
        if self.call("cuGetErrorName", rc, ctypes.byref(text)) == 0 and text.value:
            return text.value.decode()
        return "CUDA_ERROR"


def devices(drv: Driver) -> list[dict[str, object]]:
    drv.check("cuInit", 0)
    count = ctypes.c_int()
    drv.check("cuDeviceGetCount", ctypes.byref(count))
    result = []
    for ordinal in range(count.value):
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        drv.check("cuDeviceGet", ctypes.byref(dev), ordinal)
        name = ctypes.create_string_buffer(256)
        drv.check("cuDeviceGetName", name, len(name), dev)
        total_dev = ctypes.c_size_t()
        drv.check("cuDeviceTotalMem_v2", ctypes.byref(total_dev), dev)
        drv.check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        drv.check("cuCtxSetCurrent", ctx)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        drv.check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        result.append({"device": ordinal, "name": name.value.decode(), "total_mem": total_dev.value,
                       "mem_info_free": free.value, "mem_info_total": total.value})
    return result


def allocate(drv: Driver, nbytes: int) -> dict[str, object]:
    """One cuMemAlloc on device 0 (its primary context), freed again on success."""
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    drv.check("cuDeviceGet", ctypes.byref(dev), 0)
    drv.check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    drv.check("cuCtxSetCurrent", ctx)
    rc = drv.call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
    if rc == 0:
        drv.check("cuMemFree_v2", ptr)
    return {"bytes": nbytes, "result": rc, "error": None if rc == 0 else drv.error_name(rc)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocate", type=parse_size, metavar="SIZE", help="try one allocation on device 0")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--library", default="libcuda.so.1", help="driver library to load")
    args = parser.parse_args(argv)
    drv = Driver(args.library)
    report: dict[str, object] = {"devices": devices(drv)}
    if args.allocate is not None:
        report["allocation"] = allocate(drv, args.allocate)
    if args.json:
        print(json.dumps(report))
    else:
        for d in report["devices"]:  # type: ignore[union-attr]
            print(f"device {d['device']} ({d['name']}): total {d['total_mem'] / 2**30:.2f} GiB, "
                  f"cuMemGetInfo free {d['mem_info_free'] / 2**30:.2f} of {d['mem_info_total'] / 2**30:.2f} GiB")
        if "allocation" in report:
            a = report["allocation"]
            outcome = "ok" if a["result"] == 0 else f"{a['error']} ({a['result']})"  # type: ignore[index]
            print(f"cuMemAlloc {a['bytes'] / 2**30:.2f} GiB on device 0: {outcome}")  # type: ignore[index]
    refused = "allocation" in report and report["allocation"]["result"] != 0  # type: ignore[index]
    return 3 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
