"""MIG instances as mpsd sees them: what NVML says of each (mpsd/inventory/nvml.py reads it), the
profile name operators know them by, and the /dev/nvidia-caps minors a container needs. Pure.

mpsd never creates, destroys or reconfigures MIG instances: the GPU operator's MIG manager or
the admin does (``nvidia-smi mig``). mpsd reads the layout every inventory round and serves
whatever instances exist (docs/mig.md).

A MIG device (NVML's name for a compute instance inside a GPU instance) has

- its own UUID ``MIG-...`` (NVML: "globally unique", "immutable for the lifetime of a MIG
  device"), which is also what CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES take;
- its GPU instance and compute instance IDs (unique per GPU, resp. per GPU instance, valid
  until destroyed), its memory and SM count (nvmlDeviceGetMemoryInfo and
  nvmlDeviceGetAttributes on its handle);
- a profile: ``<g>g.<gb>gb`` when its compute instance spans its GPU instance, else
  ``<c>c.<g>g.<gb>gb`` (NVIDIA's MIG user guide, "MIG Device Names"), with the attribute its GPU
  instance profile ID carries (``+me``, ``+me.all``, ``+gfx``, ``-me``), derived as go-nvlib
  derives it (``pkg/nvlib/device/mig_profile.go``): from the GPU instance profile ID, the compute
  slices and the memory, never from the tail of NVML's device name;
- a memory shared by every compute instance of its GPU instance (CUPTI on MIG; the MIG user
  guide's three ``1c.3g.20gb`` are all 20gb): mpsd sells each compute instance
  ``ci_slices/gi_slices`` of it, so the slices of one GPU instance never sum to more than it has
  (:func:`ci_share`, docs/mig.md);
- two access capabilities, ``gpu<minor>/gi<gi>/access`` and ``gpu<minor>/gi<gi>/ci<ci>/access``
  in /proc/driver/nvidia-caps/mig-minors, each the minor of ``/dev/nvidia-caps/nvidia-cap<N>``
  (MIG user guide, "Device Nodes and Capabilities").
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

CAPS_FILE = "/proc/driver/nvidia-caps/mig-minors"
CAPS_DEV_DIR = "/dev/nvidia-caps"
MAX_CAPS_BYTES = 1 << 20
MIB, GIB = 1 << 20, 1 << 30
# NVML_GPU_INSTANCE_PROFILE_* (nvml.h) -> (compute slices, the attribute go-nvlib prints)
GI_PROFILES: dict[int, tuple[int, str]] = {
    0x0: (1, ""), 0x1: (2, ""), 0x2: (3, ""), 0x3: (4, ""), 0x4: (7, ""), 0x5: (8, ""), 0x6: (6, ""),
    0x7: (1, "+me"), 0x8: (2, "+me"), 0x9: (1, ""),  # REV1: media extensions; REV2: twice the memory
    0xA: (1, "+gfx"), 0xB: (2, "+gfx"), 0xC: (4, "+gfx"),
    0xD: (1, "-me"), 0xE: (2, "-me"),  # NO_ME: none of the decoders, encoders, JPEG, OFA
    0xF: (1, "+me.all"), 0x10: (2, "+me.all"),  # ALL_ME: all of them
}
GI_PROFILE_COUNT = 0x12  # NVML_GPU_INSTANCE_PROFILE_COUNT
_CAPS_LINE = re.compile(r"gpu([0-9]+)/gi([0-9]+)(?:/ci([0-9]+))?/access\s+([0-9]+)")


@dataclass(frozen=True)
class MigDevice:
    uuid: str  # MIG-...
    parent_index: int  # the GPU's NVML index
    parent_uuid: str
    mig_index: int  # NVML's index of the MIG device under its GPU
    gpu_instance: int
    compute_instance: int
    profile: str  # 1g.10gb, 1c.3g.40gb, 1g.10gb+me
    name: str  # NVML's MIG device name
    memory_total: int  # bytes
    memory_used: int  # bytes
    sm_count: int
    gi_slices: int
    ci_slices: int
    compute_capability: tuple[int, int]
    parent_minor: int | None = None  # /dev/nvidia<minor>; None where NVML does not say
    gi_profile_id: int | None = None  # NVML_GPU_INSTANCE_PROFILE_*; None: not known (then not offered)
    placement_start: int | None = None  # the GPU instance's first memory slice; None without privileges
    parent_name: str = ""  # the parent GPU's product name
    gi_memory: int = 0  # bytes of its GPU instance, shared by its compute instances (memory_total: its share)
    engines: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)  # copy engines, decoders, encoders, JPEG, OFA
    problem: str = ""  # why it is not offered (no caps node, unknown profile); "" when it is
    caps_minors: tuple[int, int] | None = None  # nvidia-cap minors (GI access, CI access); None: unknown
    slices: int = 0  # how many slices the faces offer (mpsd.mig.fleet sets it from the config); 0: none
    sm_partitions: bool = False  # its daemon runs with -S: slices get static SM partitions (mpsd/daemon/smpartition.py)

    mig = True  # a MIG instance, not a whole GPU (mpsd.lifecycle.health, the faces)

    @property
    def index(self) -> int:
        """The parent's index: the faces order and label devices by the GPU they are on."""
        return self.parent_index

    @property
    def device_nodes(self) -> tuple[str, ...]:
        """What a container of this instance needs besides /dev/nvidiactl and friends."""
        nodes = [] if self.parent_minor is None else [f"/dev/nvidia{self.parent_minor}"]
        if self.caps_minors is not None:
            nodes += [f"{CAPS_DEV_DIR}/nvidia-cap{m}" for m in self.caps_minors]
        return tuple(nodes)

    def describe(self) -> str:
        return (f"{self.uuid} ({self.profile} on GPU {self.parent_index}, gi {self.gpu_instance} "
                f"ci {self.compute_instance}, {self.memory_total // MIB} MiB, {self.sm_count} SMs)")


def memory_gb(instance_mib: int, gpu_total: int) -> int:
    """The ``<gb>`` of a profile: the instance's share of the GPU's memory rounded up to an eighth
    (MIG hands out memory in eighths), times the GPU's memory in whole GiB rounded up, rounded
    to the nearest integer. This is how NVIDIA's tools arrive at ``1g.10gb`` for a 9.75 GiB
    instance of an 80 GB card (go-nvlib's MIG profile, checked against nvidia-smi's names)."""
    if gpu_total <= 0 or instance_mib <= 0:
        return max(0, round(instance_mib / 1024))
    eighths = math.ceil(instance_mib * MIB * 8 / gpu_total) / 8
    return int(round(eighths * math.ceil(gpu_total / GIB)))


def profile_name(gi_profile_id: int | None, ci_slices: int, instance_mib: int, gpu_total: int) -> str | None:
    """The profile as go-nvlib names it: ``<g>g.<gb>gb`` or ``<c>c.<g>g.<gb>gb``, then the attribute
    of the GPU instance profile (``1g.10gb+me``, ``1g.10gb-me``); None for a profile ID mpsd does not
    know (such an instance is not offered: guessing would merge two profiles into one resource)."""
    if gi_profile_id not in GI_PROFILES:
        return None
    gi_slices, attribute = GI_PROFILES[gi_profile_id]
    gb = memory_gb(instance_mib, gpu_total)
    base = f"{gi_slices}g.{gb}gb" if ci_slices == gi_slices else f"{ci_slices}c.{gi_slices}g.{gb}gb"
    return base + attribute


def ci_share(gi_memory: int, ci_slices: int, gi_slices: int) -> int:
    """The bytes mpsd sells of a compute instance: its compute slices' part of its GPU instance's
    memory, whole MiB. Compute instances of one GPU instance share that memory, and their compute
    slices sum to at most the GPU instance's, so their shares never sum to more than it has."""
    if gi_slices <= 0 or ci_slices >= gi_slices:
        return gi_memory
    return gi_memory * ci_slices // gi_slices // MIB * MIB


def profile_slug(profile: str) -> str:
    """A profile in a DNS label, as NVIDIA's DRA driver writes it in device names: ``1g.10gb+me`` ->
    ``1g10gbme``, ``1g.10gb-me`` -> ``1g10gb-me``."""
    return re.sub(r"[^a-z0-9-]", "", profile.lower())


def parse_caps(text: str) -> dict[tuple[int, int, int | None], int]:
    """``/proc/driver/nvidia-caps/mig-minors`` -> {(gpu minor, gi, ci or None): cap minor}; other
    lines (``config``, ``monitor``) and anything malformed are left out."""
    caps: dict[tuple[int, int, int | None], int] = {}
    for line in text.splitlines():
        match = _CAPS_LINE.fullmatch(line.strip())
        if match:
            gpu, gi, ci, minor = match.groups()
            caps[(int(gpu), int(gi), None if ci is None else int(ci))] = int(minor)
    return caps


def read_caps(path: str = CAPS_FILE) -> dict[tuple[int, int, int | None], int]:
    """The caps file parsed; empty when it cannot be read (no MIG-capable driver, a container
    without /proc/driver): device nodes are then left to the container runtime."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        return parse_caps(os.read(fd, MAX_CAPS_BYTES).decode("ascii", "replace"))
    except OSError:
        return {}
    finally:
        os.close(fd)


def caps_minors(caps: Mapping[tuple[int, int, int | None], int], gpu_minor: int | None, gi: int,
                ci: int) -> tuple[int, int] | None:
    if gpu_minor is None:
        return None
    gi_minor, ci_minor = caps.get((gpu_minor, gi, None)), caps.get((gpu_minor, gi, ci))
    return None if gi_minor is None or ci_minor is None else (gi_minor, ci_minor)


def by_profile(devices: Iterable[MigDevice]) -> dict[str, list[MigDevice]]:
    """Instances grouped by profile, each group in (GPU, GPU instance, compute instance) order."""
    groups: dict[str, list[MigDevice]] = {}
    for d in sorted(devices, key=lambda d: (d.parent_index, d.gpu_instance, d.compute_instance)):
        groups.setdefault(d.profile, []).append(d)
    return groups


# -- dividing an instance into slices -------------------------------------------------------------

MPS_CLIENTS = 48  # per device (Volta+, to CUDA 13.0; 60 from 13.1): the conservative figure
COMPUTE_SLICES = 7  # compute slices of every MIG-capable GPU so far (A30: 4, counted as 7: conservative)
MIN_SLICE_SMS = 2  # MPS rounds a thread percentage down to whole TPCs (2 SMs): less gives a client nothing
MIN_SLICE_MIB = 256  # what a CUDA context and its libraries take (mpsd/dra/slices.py's minimum)


def mps_clients(ci_slices: int) -> int:
    """MPS clients one server of this compute instance takes: "the maximum number of clients (48)
    is lowered proportionally to the Compute Instance size" (MIG user guide, CUDA concurrency)."""
    return max(1, MPS_CLIENTS * ci_slices // COMPUTE_SLICES)


def slice_limit(device: MigDevice) -> tuple[int, str]:
    """(the most slices ``device`` can hold, why no more)."""
    bounds = [
        (mps_clients(device.ci_slices), f"its compute instance takes {mps_clients(device.ci_slices)} MPS clients "
                                        f"({MPS_CLIENTS} x {device.ci_slices}/{COMPUTE_SLICES})"),
        (device.sm_count // MIN_SLICE_SMS, f"{device.sm_count} SMs give {device.sm_count // MIN_SLICE_SMS} slices of "
                                           f"{MIN_SLICE_SMS} SMs"),
        (device.memory_total // MIB // MIN_SLICE_MIB, f"{device.memory_total // MIB} MiB give "
                                                      f"{device.memory_total // MIB // MIN_SLICE_MIB} slices of "
                                                      f"{MIN_SLICE_MIB} MiB"),
    ]
    return min(bounds, key=lambda b: b[0])


class CannotDivide(ValueError):
    """An instance cannot hold the configured number of slices (one line)."""


def slices_for(device: MigDevice, setting: str | int, slices_per_gpu: int) -> int:
    """Slices of ``device`` for ``mig.slicesPerInstance``: ``auto`` is slicesPerGpu or the most the
    instance holds, whichever is fewer; a number is that many, or CannotDivide naming the profile."""
    most, why = slice_limit(device)
    if setting == "auto":
        return max(1, min(slices_per_gpu, most))
    if int(setting) > most:
        raise CannotDivide(f"MIG profile {device.profile} ({device.uuid}) cannot be divided into {setting} slices: "
                           f"{why}; expected mig.slicesPerInstance at most {most}, or auto")
    return int(setting)
