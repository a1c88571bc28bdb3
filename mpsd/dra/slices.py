"""ResourceSlice objects for a node's GPUs (resource.k8s.io/v1). Pure: GPUs in, JSON dicts out.

Capacity mode: one device per GPU that many claims share (``allowMultipleAllocations``), with
two consumable capacities and the request policy the scheduler applies to every claim:

- ``memory``: value = the GPU's memory in whole MiB; validRange min 256Mi, step 1Mi, max =
  the value. Step 1Mi because MPS's pinned memory limit is written in whole MiB (``M``/``G``
  suffixes): any consumed amount min + n*1Mi is a limit MPS and the shim enforce exactly,
  and the scheduler rounds a request up to it. Min 256Mi because the limit also counts the
  CUDA context and library workspaces of each client process: a smaller slice cannot start
  a CUDA program, so it is refused at scheduling instead of failing in the pod.
- ``compute``: percent of the GPU's SMs (the MPS active thread percentage): value 100,
  validRange min 1, step 1, max 100. Whole percents; MPS rounds further down to what the
  hardware can partition.
- defaults (what a claim that names no amount consumes): one device plugin slice,
  ``devicePlugin.slicesPerGpu`` = N: memory floor(MiB/N) (at least the minimum), compute
  floor(100/N) (at least 1). A claim asking only for memory gets a slice's compute, and the
  reverse.

Slices mode: N devices per GPU, each allocated whole to one claim, with the slice's memory
and compute as (fixed) capacities, so ``capacity.requests`` and CEL selectors still pick by size.

GPUs with MIG enabled are not published whole: their instances are, next to the whole GPUs
(mpsd/dra/migdevices.py; an instance is a ``mpsd.inventory.mig.MigDevice`` among ``gpus``). A pool (named
after the node) is written as one ResourceSlice per GPU, a MIG GPU's instances together
(ceil(devices/64) for a GPU of more than 64 devices: the API allows at most 64 in a slice once
a device has taints). One GPU per slice because the 1.34 scheduler checks a request's capacity
against the device at the request's index in the slice, not the device it picked
(kubernetes/kubernetes#133705, fixed in 1.35 by #133706 and not backported): in a slice of one
device that is the right device (a MIG GPU's slice holds several instances: on 1.34 use
``dra.mode: slices`` there, docs/mig.md).

Taints (``taints``: GPU index -> DeviceTaints, spec.devices[].taints, GA in 1.37) go on every
device of their whole GPU. ``comparable`` leaves out a taint's ``timeAdded``: the API server sets it
when a write does not (the field's description in the 1.37 schema).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, Protocol

from ..inventory.mig import MigDevice
from . import devices as dv
from . import migdevices
from .values import MIB, MIN_MEMORY_MIB, Obj, capacity, quantity, semver
from .quantity import parse_quantity  # exact, as the API server reads quantities

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES_PER_SLICE = 64  # the API's limit for a slice with taints (128 without)


class WholeGpu(Protocol):
    """A whole GPU as its devices are published (mpsd.inventory.nvml.GpuInfo). Read-only."""

    @property
    def index(self) -> int: ...

    @property
    def uuid(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def memory_total(self) -> int: ...

    @property
    def compute_capability(self) -> tuple[int, int]: ...

    @property
    def mig_enabled(self) -> bool: ...


GpuLike = WholeGpu | MigDevice  # what a pool publishes: whole GPUs, and MIG instances (mpsd/dra/migdevices.py)


def _attributes(gpu: WholeGpu, driver_version: str) -> Obj:
    attrs: Obj = {
        dv.ATTR_INDEX: {"int": gpu.index},
        dv.ATTR_UUID: {"string": gpu.uuid[:64]},
        dv.ATTR_PRODUCT_NAME: {"string": gpu.name[:64]},
        dv.ATTR_COMPUTE_CAPABILITY: {"version": "{}.{}.0".format(*gpu.compute_capability)},
        dv.ATTR_MEMORY: {"int": gpu.memory_total},
        dv.ATTR_MPS: {"bool": True},
    }
    version = semver(driver_version)
    if version is not None:
        attrs[dv.ATTR_DRIVER_VERSION] = {"version": version}
    return attrs


def capacity_device(gpu: WholeGpu, driver_version: str, slices_per_gpu: int) -> Obj:
    """The one shared device of a GPU in capacity mode; ValueError for a GPU below the minimum."""
    mib = gpu.memory_total // MIB
    if mib <= MIN_MEMORY_MIB:
        raise ValueError(f"GPU {gpu.index} ({gpu.uuid}) has {mib} MiB: capacity mode needs more than {MIN_MEMORY_MIB}")
    memory_default = min(mib, max(MIN_MEMORY_MIB, mib // slices_per_gpu))
    compute_default = max(1, 100 // slices_per_gpu)
    return {
        "name": dv.device_name(gpu.index),
        "attributes": _attributes(gpu, driver_version),
        "allowMultipleAllocations": True,
        "capacity": {
            dv.MEMORY: capacity(*(quantity(n * MIB, True) for n in (mib, memory_default, MIN_MEMORY_MIB, mib, 1))),
            dv.COMPUTE: capacity("100", str(compute_default), "1", "100", "1"),
        },
    }


def slice_devices(gpu: WholeGpu, driver_version: str, slices_per_gpu: int) -> list[Obj]:
    """The N devices of a GPU in slices mode."""
    compute = quantity(dv.slice_compute(slices_per_gpu))
    out = []
    for k in range(slices_per_gpu):
        attrs = _attributes(gpu, driver_version)
        attrs[dv.ATTR_SLICE] = {"int": k}
        attrs[dv.ATTR_SLICES] = {"int": slices_per_gpu}
        memory = quantity(dv.slice_memory(gpu.memory_total, slices_per_gpu, k), binary=True)
        out.append({
            "name": dv.device_name(gpu.index, k),
            "attributes": attrs,
            "capacity": {dv.MEMORY: {"value": memory}, dv.COMPUTE: {"value": compute}},
        })
    return out


def build_devices(gpus: Sequence[GpuLike], mode: str, slices_per_gpu: int, driver_version: str = "",
                  taints: Mapping[int, Sequence[Obj]] | None = None) -> list[Obj]:
    """Every device of the node's pool, GPUs in index order, each with its GPU's ``taints``;
    ValueError for a bad mode or count."""
    if mode not in dv.MODES:
        raise ValueError(f"bad dra.mode {mode!r}: expected one of {', '.join(dv.MODES)}")
    if not 1 <= slices_per_gpu <= 100:
        raise ValueError(f"bad slicesPerGpu {slices_per_gpu!r}: expected an integer 1..100")
    out: list[Obj] = []
    instances = [g for g in gpus if isinstance(g, MigDevice)]
    for gpu in sorted((g for g in gpus if not isinstance(g, MigDevice) and not g.mig_enabled), key=lambda g: g.index):
        mine = [capacity_device(gpu, driver_version, slices_per_gpu)] if mode == "capacity" \
            else slice_devices(gpu, driver_version, slices_per_gpu)
        for device in mine:
            mark = (taints or {}).get(gpu.index)
            if mark:
                device["taints"] = [dict(t) for t in mark]
        out.extend(mine)
    return out + migdevices.build(instances, mode, driver_version)


def slice_name_prefix(node: str, driver: str) -> str:
    """``generateName`` of the node's slices: ``<node>-<driver>-``, cut to leave the API
    server room for its 5 random characters within a name's 253."""
    return f"{node}-{driver}"[:240] + "-"


def node_owner(node: str, uid: str) -> list[Obj]:
    """``ownerReferences`` naming the Node: the garbage collector deletes the slices with it."""
    return [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid, "controller": True}]


def build_slices(devices: list[Obj], driver: str, node: str, generation: int, node_uid: str | None = None) -> list[Obj]:
    """The pool's ResourceSlices: one per GPU, at most 64 devices each (one, empty, for no
    devices), all with ``generation`` and the count, no names (``generateName``; the publisher
    reuses names), owned by the Node when its ``node_uid`` is known."""
    chunks = [group[i:i + MAX_DEVICES_PER_SLICE] for group in _by_gpu(devices)
              for i in range(0, len(group), MAX_DEVICES_PER_SLICE)] or [[]]
    metadata: Obj = {"generateName": slice_name_prefix(node, driver)}
    if node_uid:
        metadata["ownerReferences"] = node_owner(node, node_uid)
    return [{
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": dict(metadata),
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)},
            "devices": chunk,
        },
    } for chunk in chunks]


def _by_gpu(devices: list[Obj]) -> list[list[Obj]]:
    """Consecutive devices of one GPU (the ``index`` attribute) as one group each."""
    groups: list[list[Obj]] = []
    last: object = object()
    for device in devices:
        index = ((device.get("attributes") or {}).get(dv.ATTR_INDEX) or {}).get("int")
        if not groups or index != last:
            groups.append([])
        groups[-1].append(device)
        last = index
    return groups


def comparable(devices: list[Obj]) -> list[Obj]:
    """``devices`` with every quantity as its exact number, so what the API server stored
    ("16Gi", "17179869184") compares equal to what we would write; taints without the
    ``timeAdded`` the server adds."""
    out = []
    for d in devices:
        d = {**d, "capacity": {k: _numbers(v) for k, v in (d.get("capacity") or {}).items()}}
        if d.get("taints"):
            d["taints"] = [{k: v for k, v in t.items() if k != "timeAdded"} for t in d["taints"]]
        else:
            d.pop("taints", None)
        out.append(d)
    return out


def _numbers(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _numbers(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_numbers(v) for v in node]
    if isinstance(node, str):
        return _parse_quantity(node)
    return node


def _parse_quantity(text: str) -> Fraction | str:
    try:
        return parse_quantity(text)
    except ValueError:
        return text


# What the API server drops from a device when a feature gate is off (the registry strategy's
# dropDisabledFields, pkg/registry/resource/resourceslice/strategy.go): field -> gate.
GATED_FIELDS = {
    "allowMultipleAllocations": "DRAConsumableCapacity",
    "capacity.requestPolicy": "DRAConsumableCapacity",
    "taints": "DRADeviceTaints",
}
UNKNOWN_GATE = "unknown"


def dropped_fields(sent: list[Obj], stored: list[Obj]) -> dict[str, list[str]]:
    """Fields of ``sent`` devices that the API server did not store, by the feature gate that
    governs them ({"DRAConsumableCapacity": ["allowMultipleAllocations", ...]}); any other
    difference is listed under "unknown". Empty when the server stored what was sent (by
    value, server-set ``timeAdded`` aside), as the DRA helper's DroppedFieldsError judges it."""
    by_name = {d.get("name"): d for d in comparable(stored)}
    out: dict[str, set[str]] = {}
    for want in comparable(sent):
        have = by_name.get(want.get("name"))
        if have is None or have == want:
            if have is None:
                out.setdefault(UNKNOWN_GATE, set()).add("devices")
            continue
        missing = set()
        if want.get("allowMultipleAllocations") and not have.get("allowMultipleAllocations"):
            missing.add("allowMultipleAllocations")
        if any(c.get("requestPolicy") and not (have.get("capacity") or {}).get(k, {}).get("requestPolicy")
               for k, c in (want.get("capacity") or {}).items()):
            missing.add("capacity.requestPolicy")
        if len(want.get("taints") or []) > len(have.get("taints") or []):
            missing.add("taints")
        for field in missing:
            out.setdefault(GATED_FIELDS[field], set()).add(field)
        if not missing or _without(want, missing) != _without(have, missing):
            other = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k) and k not in missing)
            out.setdefault(UNKNOWN_GATE, set()).update(other or ["devices"])
    return {gate: sorted(fields) for gate, fields in sorted(out.items())}


def _without(device: Obj, fields: set[str]) -> Obj:
    """``device`` (comparable) less the gated ``fields``: what is left must match."""
    out = {k: v for k, v in device.items() if k not in fields}
    if "capacity.requestPolicy" in fields:
        out["capacity"] = {k: {f: x for f, x in c.items() if f != "requestPolicy"}
                           for k, c in (device.get("capacity") or {}).items()}
    return out
