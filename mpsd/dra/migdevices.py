"""MIG instances as DRA devices. Pure: instances in, device dicts (resource.k8s.io/v1) out.

Each instance mpsd serves (mpsd/mig/fleet.py) is published in the node's pool next to the whole
GPUs, named as NVIDIA's DRA driver names MIG devices, by what the instance *is* rather than by
IDs NVML hands out again: ``gpu-<parent minor>-mig-<profile>-<GPU instance profile ID>-<placement
start>`` (``gpu-0-mig-1g10gb-0-3``). GPU and compute instance IDs are reused after a destroy and
create; a name that encodes profile and placement is taken again only by an instance of the same
profile in the same place (where NVML does not give an unprivileged caller the placement, ``gi<ID>``
stands in for it; a compute instance narrower than its GPU instance adds ``-ci<ID>``). A claim
prepared onto one instance is refused again once that instance's UUID is gone (mpsd/dra/prepared.py).

- capacity mode: the name above, shared by many claims (``allowMultipleAllocations``) with the
  capacities a whole GPU has, of the instance: ``memory`` (its share, whole MiB, at least 256Mi a
  claim) and ``compute`` (percent of its SMs);
- slices mode: ``<name>-slice-<k>``, N per instance (``mig.slicesPerInstance``), each the device
  plugin's share.

As NVIDIA's driver publishes them, so that a DeviceClass written for it selects the same instances
(in this driver's domain): attributes ``type`` (``mig``), ``uuid`` (``MIG-...``), ``parentUUID``,
``profile`` (go-nvlib's spelling, ``1g.10gb+me``), ``productName`` (the parent's), and capacities
``multiprocessors``, ``copyEngines``, ``decoders``, ``encoders``, ``jpegEngines``, ``ofaEngines`` and
``memorySlice<i>`` per memory slice of its placement (in capacity mode with a request policy that
consumes none of them by default: they describe, the claims share). Also ``index`` (the parent's),
``computeCapability``, ``driverVersion``, ``memory`` (bytes sold), ``migGpuInstance``,
``migComputeInstance``, ``mig`` (true), ``smPartitions`` and ``mps`` (true). A CEL selector picks a
profile with ``device.attributes["gpu.mpsd.io"].profile == "1g.10gb"``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from ..inventory.mig import MigDevice, profile_slug
from . import devices as dv
from .values import MIB, MIN_MEMORY_MIB, capacity, quantity, semver

log = logging.getLogger(__name__)

Obj = dict[str, Any]
_NAME = re.compile(r"(gpu-(?:0|[1-9][0-9]{0,3})-mig-[a-z0-9][a-z0-9-]{0,40}?)(?:-slice-(0|[1-9][0-9]?))?")
NAME_FORM = ("gpu-<minor>-mig-<profile>-<GI profile ID>-<placement start> (capacity mode), with -slice-<k> "
             "(slices mode)")
ENGINES = ("copyEngines", "decoders", "encoders", "jpegEngines", "ofaEngines")
_MEMORY_SLICES = {1: 1, 2: 2, 3: 4, 4: 4, 6: 8, 7: 8, 8: 8}  # memory slices a GPU instance of N compute slices holds


def device_name(device: MigDevice, k: int | None = None) -> str:
    minor = device.parent_minor if device.parent_minor is not None else device.parent_index
    where = device.placement_start if device.placement_start is not None else f"gi{device.gpu_instance}"
    base = f"gpu-{minor}-mig-{profile_slug(device.profile)}-{device.gi_profile_id}-{where}"
    if device.ci_slices != device.gi_slices:
        base += f"-ci{device.compute_instance}"
    return base if k is None else f"{base}-slice-{k}"


def parse_name(name: object) -> tuple[str, int | None] | None:
    """``gpu-0-mig-1g10gb-0-3`` -> (that, None), ``...-slice-2`` -> (``gpu-0-mig-1g10gb-0-3``, 2); None
    when the name is not a MIG device's (a whole GPU's, or malformed)."""
    match = _NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        return None
    base, k = match.groups()
    return base, None if k is None else int(k)


def find(devices: Sequence[MigDevice], name: object) -> tuple[MigDevice | None, int | None]:
    """The instance a device name stands for (None when none served has that name) and the slice."""
    parsed = parse_name(name)
    if parsed is None:
        return None, None
    base, k = parsed
    match = [d for d in devices if device_name(d) == base]
    return (match[0] if match else None), k


def _attributes(device: MigDevice, driver_version: str) -> Obj:
    attrs: Obj = {
        "type": {"string": "mig"},
        dv.ATTR_INDEX: {"int": device.parent_index},
        dv.ATTR_UUID: {"string": device.uuid[:64]},
        "parentUUID": {"string": device.parent_uuid[:64]},
        "profile": {"string": device.profile[:64]},
        dv.ATTR_PRODUCT_NAME: {"string": (device.parent_name or device.name)[:64]},
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


def hardware(device: MigDevice, shared: bool) -> Obj:
    """The capacities NVIDIA's driver gives a MIG device: SMs, engines, its memory slices; ``shared``
    (capacity mode) with a policy by which a claim consumes none of them unless it asks."""
    counts = {"multiprocessors": device.sm_count, **dict(zip(ENGINES, device.engines, strict=True))}
    if device.placement_start is not None:
        size = _MEMORY_SLICES.get(device.gi_slices, device.gi_slices)
        counts.update({f"memorySlice{i}": 1 for i in range(device.placement_start, device.placement_start + size)})
    if not shared:
        return {name: {"value": str(n)} for name, n in counts.items()}
    return {name: capacity(str(n), "0", "0", str(n), "1") if n else {"value": "0"} for name, n in counts.items()}


def build(instances: Sequence[MigDevice], mode: str, driver_version: str = "") -> list[Obj]:
    """The devices of the instances, in (GPU, GPU instance, compute instance) order, each divided into
    ``device.slices`` (mpsd.mig.fleet sets it; 0: the configuration cannot divide it, said once
    there, and it is left out, as is an instance below the minimum)."""
    out: list[Obj] = []
    for device in sorted(instances, key=lambda d: (d.parent_index, d.gpu_instance, d.compute_instance)):
        n = device.slices
        if n < 1 or device.problem:
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
                    **hardware(device, shared=True),
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
                             dv.COMPUTE: {"value": quantity(dv.slice_compute(n))}, **hardware(device, shared=False)},
            })
    return out


def caps_nodes(devices: Sequence, uuids: Sequence[str]) -> list[str]:
    """The /dev/nvidia-caps nodes of the MIG instances among ``uuids`` (their GPU instance's and
    compute instance's access capabilities), relative to /dev (mpsd/dra/cdi.py device_nodes keeps
    those the host has)."""
    by_uuid = {d.uuid: d for d in devices if getattr(d, "mig", False)}
    nodes = []
    for uuid in uuids:
        device = by_uuid.get(uuid)
        nodes += [f"nvidia-caps/nvidia-cap{minor}" for minor in ((device.caps_minors or ()) if device else ())]
    return nodes
