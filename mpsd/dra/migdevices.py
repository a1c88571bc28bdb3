"""MIG instances as DRA devices. Pure: instances in, device dicts (resource.k8s.io/v1) out.

Each instance mpsd serves (mpsd/mig/fleet.py) is published in the node's pool next to the whole
GPUs, named after where it is (names must be stable while it exists and DNS labels):

- capacity mode: ``gpu-<parent index>-mig-<gi>-<ci>``, shared by many claims
  (``allowMultipleAllocations``) with the capacities a whole GPU has, of the instance:
  ``memory`` (its bytes, whole MiB, at least 256Mi a claim) and ``compute`` (percent of its SMs);
- slices mode: ``gpu-<parent index>-mig-<gi>-<ci>-slice-<k>``, N per instance
  (``mig.slicesPerInstance``), each the device plugin's share.

Attributes (in the driver's domain, like a whole GPU's): ``index`` (the parent's), ``uuid``
(``MIG-...``), ``parentUUID``, ``profile`` (``1g.10gb``), ``productName`` (NVML's MIG device name),
``computeCapability``, ``driverVersion``, ``memory`` (the instance's bytes), ``multiprocessors``
(its SMs), ``migGpuInstance``, ``migComputeInstance``, ``mig`` (true; false on whole GPUs is
left out), ``smPartitions`` (true where the instance's slices get static SM partitions, the
``compute`` capacity then granted in whole chunks) and ``mps`` (true). A CEL selector picks a profile with
``device.attributes["gpu.mpsd.io"].profile == "1g.10gb"``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from ..inventory.mig import MigDevice
from . import devices as dv
from .values import MIB, MIN_MEMORY_MIB, capacity, quantity, semver

log = logging.getLogger(__name__)

Obj = dict[str, Any]
_NAME = re.compile(r"gpu-(0|[1-9][0-9]{0,3})-mig-(0|[1-9][0-9]{0,2})-(0|[1-9][0-9]{0,2})(?:-slice-(0|[1-9][0-9]?))?")
NAME_FORM = "gpu-<index>-mig-<gi>-<ci> (capacity mode) or gpu-<index>-mig-<gi>-<ci>-slice-<k> (slices mode)"


def device_name(device: MigDevice, k: int | None = None) -> str:
    base = f"gpu-{device.parent_index}-mig-{device.gpu_instance}-{device.compute_instance}"
    return base if k is None else f"{base}-slice-{k}"


def parse_name(name: object) -> tuple[int, int, int, int | None] | None:
    """``gpu-1-mig-9-0`` -> (1, 9, 0, None), ``gpu-1-mig-9-0-slice-2`` -> (1, 9, 0, 2); None when the
    name is not a MIG device's (a whole GPU's, or malformed)."""
    match = _NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        return None
    gpu, gi, ci, k = match.groups()
    return int(gpu), int(gi), int(ci), None if k is None else int(k)


def find(devices: Sequence[MigDevice], name: object) -> tuple[MigDevice | None, int | None]:
    """The instance a device name stands for (None when it is not served) and the slice number."""
    parsed = parse_name(name)
    if parsed is None:
        return None, None
    gpu, gi, ci, k = parsed
    match = [d for d in devices if (d.parent_index, d.gpu_instance, d.compute_instance) == (gpu, gi, ci)]
    return (match[0] if match else None), k


def _attributes(device: MigDevice, driver_version: str) -> Obj:
    attrs: Obj = {
        dv.ATTR_INDEX: {"int": device.parent_index},
        dv.ATTR_UUID: {"string": device.uuid[:64]},
        "parentUUID": {"string": device.parent_uuid[:64]},
        "profile": {"string": device.profile[:64]},
        dv.ATTR_PRODUCT_NAME: {"string": device.name[:64]},
        dv.ATTR_COMPUTE_CAPABILITY: {"version": "{}.{}.0".format(*device.compute_capability)},
        dv.ATTR_MEMORY: {"int": device.memory_total},
        "multiprocessors": {"int": device.sm_count},
        "migGpuInstance": {"int": device.gpu_instance},
        "migComputeInstance": {"int": device.compute_instance},
        "mig": {"bool": True},
        "smPartitions": {"bool": bool(device.sm_partitions)},  # static SM partitions (daemon/smpartition.py)
        dv.ATTR_MPS: {"bool": True},
    }
    version = semver(driver_version)
    if version is not None:
        attrs[dv.ATTR_DRIVER_VERSION] = {"version": version}
    return attrs


def build(instances: Sequence[MigDevice], mode: str, driver_version: str = "") -> list[Obj]:
    """The devices of the instances, in (GPU, GPU instance, compute instance) order, each divided into
    ``device.slices`` (mpsd.mig.fleet sets it; 0: the configuration cannot divide it, said once
    there, and it is left out, as is an instance below the minimum)."""
    out: list[Obj] = []
    for device in sorted(instances, key=lambda d: (d.parent_index, d.gpu_instance, d.compute_instance)):
        n = device.slices
        if n < 1:
            continue
        mib = device.memory_total // MIB
        if mib <= MIN_MEMORY_MIB:
            log.error("MIG instance not published: %s has %d MiB, at most the %d MiB a claim needs",
                      device.uuid, mib, MIN_MEMORY_MIB)
            continue
        if mode == "capacity":
            memory_default = min(mib, max(MIN_MEMORY_MIB, mib // n))
            out.append({
                "name": device_name(device),
                "attributes": _attributes(device, driver_version),
                "allowMultipleAllocations": True,
                "capacity": {
                    dv.MEMORY: capacity(*(quantity(x * MIB, True)
                                           for x in (mib, memory_default, MIN_MEMORY_MIB, mib, 1))),
                    dv.COMPUTE: capacity("100", str(max(1, 100 // n)), "1", "100", "1"),
                },
            })
            continue
        for k in range(n):
            attrs = _attributes(device, driver_version)
            attrs[dv.ATTR_SLICE], attrs[dv.ATTR_SLICES] = {"int": k}, {"int": n}
            out.append({
                "name": device_name(device, k),
                "attributes": attrs,
                "capacity": {dv.MEMORY: {"value": quantity(dv.slice_memory(device.memory_total, n, k), binary=True)},
                             dv.COMPUTE: {"value": quantity(dv.slice_compute(n))}},
            })
    return out


def caps_nodes(devices: Sequence, uuids: Sequence[str], dev_dir: str = "/dev") -> list[str]:
    """The /dev/nvidia-caps nodes of the MIG instances among ``uuids`` (their GPU instance's and
    compute instance's access capabilities), as far as they exist on this host."""
    by_uuid = {d.uuid: d for d in devices if getattr(d, "mig", False)}
    nodes = []
    for uuid in uuids:
        device = by_uuid.get(uuid)
        for minor in (device.caps_minors or ()) if device is not None else ():
            path = os.path.join(dev_dir, "nvidia-caps", f"nvidia-cap{minor}")
            if os.path.exists(path):
                nodes.append(path)
    return nodes
