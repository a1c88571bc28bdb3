"""The DRA naming contract: device names, capacity and attribute names, each device's share. Pure.

Two modes (config ``dra.mode``):

- ``capacity`` (Kubernetes 1.34+ with the DRAConsumableCapacity feature gate; beta, on by
  default, from 1.36): one device per GPU, named ``gpu-<index>`` (``gpu-0``), shared by many
  claims (``allowMultipleAllocations``); each claim consumes some of its capacities
  ``memory`` (bytes) and ``compute`` (percent of the GPU's SMs: the MPS active thread
  percentage).
- ``slices`` (1.34 and 1.35 without the gate): N devices per GPU, named
  ``gpu-<index>-slice-<k>`` (k = 0..N-1), N = ``devicePlugin.slicesPerGpu``, each allocated
  to one claim at a time. Slice k has the device plugin's share of the memory (whole MiB;
  the N shares add up to the GPU's memory, mpsd/alloc/slicing.py) and 100/N compute.

Device attributes are published under unqualified names, which Kubernetes puts in the
driver's own domain: with the default driver name a CEL selector reads
``device.attributes["gpu.mpsd.io"].productName`` and ``device.capacity["gpu.mpsd.io"].memory``.
The ``memory`` attribute is the whole GPU's memory in bytes; the ``memory`` capacity is what
claims consume (in slices mode: the slice's share).
"""

from __future__ import annotations

import re

from ..alloc.slicing import MAX_SLICES, slice_share_bytes, thread_percentage
from ..units import shown

DEFAULT_DRIVER_NAME = "gpu.mpsd.io"
MODES = ("capacity", "slices")

# capacity names (what a claim's capacity.requests name, and consumedCapacity reports)
MEMORY = "memory"  # bytes
COMPUTE = "compute"  # percent of the GPU's SMs (MPS active thread percentage)

# attribute names (unqualified: in the driver's domain)
ATTR_INDEX = "index"  # int: the GPU's NVML index on the node
ATTR_UUID = "uuid"  # string: GPU-...
ATTR_PRODUCT_NAME = "productName"  # string, e.g. "NVIDIA H100 80GB HBM3"
ATTR_COMPUTE_CAPABILITY = "computeCapability"  # version, e.g. 9.0.0
ATTR_DRIVER_VERSION = "driverVersion"  # version, e.g. 580.95.5 (NVIDIA's 580.95.05 as semver)
ATTR_MEMORY = "memory"  # int: the whole GPU's memory in bytes
ATTR_MPS = "mps"  # bool: always true; clients reach the GPU through mpsd's MPS daemon
ATTR_SLICE = "slice"  # int, slices mode only: k of gpu-<index>-slice-<k>
ATTR_SLICES = "slices"  # int, slices mode only: N, the GPU's slice count

MAX_GPU_INDEX = 9999
_NAME = re.compile(r"gpu-(0|[1-9][0-9]{0,3})(?:-slice-(0|[1-9][0-9]?))?")
NAME_FORM = "gpu-<index> (capacity mode) or gpu-<index>-slice-<k> (slices mode)"


def device_name(gpu_index: int, slice_index: int | None = None) -> str:
    """``gpu-0`` or ``gpu-0-slice-3``; ValueError for an index out of range."""
    if not 0 <= gpu_index <= MAX_GPU_INDEX:
        raise ValueError(f"bad GPU index {gpu_index!r}: expected 0..{MAX_GPU_INDEX}")
    if slice_index is None:
        return f"gpu-{gpu_index}"
    if not 0 <= slice_index < MAX_SLICES:
        raise ValueError(f"bad slice index {slice_index!r}: expected 0..{MAX_SLICES - 1}")
    return f"gpu-{gpu_index}-slice-{slice_index}"


def parse_device_name(name: object) -> tuple[int, int | None]:
    """``"gpu-0"`` -> (0, None), ``"gpu-1-slice-3"`` -> (1, 3). Only the spelling
    :func:`device_name` writes is taken (no leading zeros), so a device has one name."""
    match = _NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"bad device name {shown(str(name))}: expected {NAME_FORM}")
    gpu, k = match.groups()
    return int(gpu), None if k is None else int(k)


def slice_memory(memory_total: int, slices_per_gpu: int, k: int) -> int:
    """Bytes of slice ``k`` of a GPU with ``memory_total`` bytes (the device plugin's share)."""
    return slice_share_bytes(memory_total, slices_per_gpu, k)


def slice_compute(slices_per_gpu: int) -> float:
    """Percent of SMs of one slice: 100/N, two decimals (as the device plugin gives one slice)."""
    return thread_percentage(1, slices_per_gpu)
