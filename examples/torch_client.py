#!/usr/bin/env python3
"""PyTorch under an mpsd slice: the memory it sees and what happens past the cap.

    python examples/torch_client.py                     # what torch sees
    python examples/torch_client.py --allocate 6G       # one tensor of that size on cuda:0
    mpsd exec --gpu-memory 4G --gpu-compute 25 -- python examples/torch_client.py --allocate 6G

In a pod that requested mpsd.io/gpu slices, or under `mpsd exec`, torch.cuda.mem_get_info()
and the device's total_memory report the slice (the shim answers cuMemGetInfo and
cuDeviceTotalMem), so PyTorch's caching allocator sizes itself to it, and an allocation
past the slice raises torch.cuda.OutOfMemoryError instead of taking a neighbour's memory.
Exit status: 0, or 3 when the requested allocation was refused.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
SLICE_VARIABLES = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                   "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "NVIDIA_VISIBLE_DEVICES", "LD_PRELOAD", "MPSSHIM_REGION")


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)I?B?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected a number with an optional K, M, G or T suffix")
    return int(match.group(1)) * SUFFIX[match.group(2)]


def report(torch: object, allocate: int | None) -> dict[str, object]:
    cuda = torch.cuda  # type: ignore[attr-defined]
    devices = []
    for index in range(cuda.device_count()):
        free, total = cuda.mem_get_info(index)
        props = cuda.get_device_properties(index)
        devices.append({"device": index, "name": props.name, "total_memory": props.total_memory,
                        "mem_get_info_free": free, "mem_get_info_total": total,
                        "multiprocessors": props.multi_processor_count})
    result: dict[str, object] = {
        "environment": {k: os.environ[k] for k in SLICE_VARIABLES if k in os.environ},
        "devices": devices,
    }
    if allocate is not None:
        try:
            tensor = torch.empty(allocate, dtype=torch.uint8, device="cuda:0")  # type: ignore[attr-defined]
        except cuda.OutOfMemoryError as exc:
            result["allocation"] = {"bytes": allocate, "ok": False, "error": str(exc).splitlines()[0]}
        else:
            del tensor
            cuda.empty_cache()
            result["allocation"] = {"bytes": allocate, "ok": True, "error": None}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocate", type=parse_size, metavar="SIZE", help="allocate one tensor on cuda:0")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("torch.cuda.is_available() is False: no GPU, driver or MPS daemon reachable", file=sys.stderr)
        return 1
    result = report(torch, args.allocate)
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in result["environment"].items():  # type: ignore[union-attr]
            print(f"{name}={value}")
        for d in result["devices"]:  # type: ignore[union-attr]
            print(f"cuda:{d['device']} {d['name']}: total_memory {d['total_memory'] / 2**30:.2f} GiB, "
                  f"mem_get_info {d['mem_get_info_free'] / 2**30:.2f} free of "
                  f"{d['mem_get_info_total'] / 2**30:.2f} GiB, {d['multiprocessors']} SMs")
        if "allocation" in result:
            a = result["allocation"]
            print(f"allocate {a['bytes'] / 2**30:.2f} GiB on cuda:0: "  # type: ignore[index]
                  f"{'ok' if a['ok'] else 'refused: ' + a['error']}")  # type: ignore[index]
    refused = "allocation" in result and not result["allocation"]["ok"]  # type: ignore[index]
    return 3 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
