#!/usr/bin/env python3
"""One client of scripts/demo.sh: a CUDA driver-API process with nothing but ctypes.

    demo_client.py NAME --allocate SIZE [--hold]

It prints what it sees (cuMemGetInfo on device 0), tries one cuMemAlloc of SIZE, prints the
result and what it sees after. With --hold it keeps a successful allocation until SIGTERM or
SIGINT (then frees it and exits 0), printing "holding" once it holds. Exit status: 0, 3 when
the allocation was refused, 1 when the driver could not be used. Run it under `mpsd exec`
to see the slice: the shim makes cuMemGetInfo report the cap and refuses what passes it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import sys

GIB = 1 << 30
SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KMGT]?)", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected a number with an optional K, M, G or T suffix")
    return int(match.group(1)) * SUFFIX[match.group(2)]


class Client:
    def __init__(self, name: str) -> None:
        self.tag = f"[{name} pid {os.getpid()}]"
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.check("cuInit", 0)
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check("cuDeviceGet", ctypes.byref(dev), 0)
        self.check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        self.check("cuCtxSetCurrent", ctx)

    def call(self, fn: str, *args: object) -> int:
        return int(getattr(self.cuda, fn)(*args))

    def check(self, fn: str, *args: object) -> None:
        rc = self.call(fn, *args)
        if rc != 0:
            raise RuntimeError(f"{fn} failed: {self.error_name(rc)} ({rc})")

    def error_name(self, rc: int) -> str:
        text = ctypes.c_char_p()
        ok = self.call("cuGetErrorName", rc, ctypes.byref(text)) == 0 and text.value
        return text.value.decode() if ok else "CUDA_ERROR"  # type: ignore[union-attr]

    def say(self, text: str) -> None:
        print(f"{self.tag} {text}", flush=True)

    def show_mem_info(self) -> None:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        self.say(f"cuMemGetInfo: total {total.value / GIB:.2f} GiB, free {free.value / GIB:.2f} GiB")

    def allocate(self, nbytes: int) -> ctypes.c_uint64 | None:
        ptr = ctypes.c_uint64()
        rc = self.call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        outcome = "ok" if rc == 0 else f"refused, {self.error_name(rc)} ({rc})"
        self.say(f"cuMemAlloc {nbytes / GIB:.2f} GiB: {outcome}")
        return ptr if rc == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="a name for the output lines")
    parser.add_argument("--allocate", type=parse_size, required=True, metavar="SIZE", help="bytes, e.g. 3G")
    parser.add_argument("--hold", action="store_true", help="keep the allocation until SIGTERM/SIGINT")
    args = parser.parse_args(argv)
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    if args.hold:  # blocked from the start, so none is lost before sigwait
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        client = Client(args.name)
        client.show_mem_info()
        ptr = client.allocate(args.allocate)
        if ptr is None:
            return 3
        client.show_mem_info()
        if args.hold:
            client.say("holding")
            signal.sigwait(stop_signals)
        client.check("cuMemFree_v2", ptr)
    except (OSError, RuntimeError) as exc:
        print(f"[{args.name}] cannot use the driver: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
