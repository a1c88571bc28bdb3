"""Pure slice arithmetic: device IDs, preferred allocation, per-container limits.

A GPU is cut into N equal slices. Slice ``k`` of a GPU is advertised to the kubelet as
``<GPU-uuid>::<k>`` (0 <= k < N). A container that holds some slices of a GPU gets

- memory: the sum of its slices' shares. Shares are whole MiB (MPS takes only M and G
  suffixes): slice k gets ``floor((k+1)*M/N) - floor(k*M/N)`` MiB of the GPU's M MiB, so
  the N shares of a GPU add up to its memory exactly (rounded down to a MiB), whatever
  N is, and no two slices share a byte;
- compute: active thread percentage ``100*k/N`` for k slices of one GPU. MPS has one
  percentage per client, so a container given slices on several GPUs gets the largest
  of its per-GPU percentages.

Nothing here touches a process, a file or a socket.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

from ..errors import PluginError
from ..units import is_decimal

SEPARATOR = "::"
MAX_DEVICE_ID = 63  # the kubelet's limit on Device.ID
MAX_SLICES = 100
MIB = 1 << 20


class GpuLike(Protocol):
    """A device slices are cut from: a whole GPU (mpsd.inventory.nvml.GpuInfo) or a MIG instance
    (mpsd.inventory.mig.MigDevice, frozen: its index is its parent's). Read-only: nothing here sets them."""

    @property
    def index(self) -> int: ...

    @property
    def uuid(self) -> str: ...

    @property
    def memory_total(self) -> int: ...


@dataclass(frozen=True, order=True)
class SliceId:
    uuid: str
    slice: int

    def __str__(self) -> str:
        return f"{self.uuid}{SEPARATOR}{self.slice}"


def slice_id(uuid: str, k: int) -> str:
    return str(SliceId(uuid, k))


def _slice_number(k: str) -> int | None:
    """The slice number of a canonical ID's tail: "0", "7", "42"; None for anything else
    ("01" would name slice 1 a second time; 5000 digits would raise in int())."""
    if not is_decimal(k) or len(k) > len(str(MAX_SLICES)) or (len(k) > 1 and k[0] == "0"):
        return None
    return int(k)


def parse_slice_id(text: str, slices_per_gpu: int) -> SliceId:
    """``"GPU-ab::3"`` -> SliceId("GPU-ab", 3); PluginError names the text otherwise. Only the
    canonical spelling we advertise is taken, so one slice has exactly one ID."""
    uuid, sep, k = text.rpartition(SEPARATOR)
    number = _slice_number(k)
    if not sep or not uuid or number is None or number >= slices_per_gpu:
        raise PluginError(
            f"bad device ID {_short(text)}: expected <GPU-uuid>::<slice> with slice 0..{slices_per_gpu - 1}"
        )
    return SliceId(uuid, number)


def _short(text: str, limit: int = 80) -> str:
    """repr of ``text``, cut to ``limit`` characters: an error line stays one short line."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def advertised_ids(gpus: Sequence[GpuLike], slices_per_gpu: int) -> list[str]:
    """Every slice of every GPU, GPUs in index order."""
    if not 1 <= slices_per_gpu <= MAX_SLICES:
        raise PluginError(f"bad slicesPerGpu {slices_per_gpu!r}: expected an integer 1..{MAX_SLICES}")
    ids = [slice_id(g.uuid, k) for g in sorted(gpus, key=lambda g: g.index) for k in range(slices_per_gpu)]
    for device_id in ids:
        if len(device_id) > MAX_DEVICE_ID:
            raise PluginError(f"device ID {device_id!r} is longer than the kubelet's {MAX_DEVICE_ID} characters")
    return ids


def slice_share_bytes(memory_total: int, slices_per_gpu: int, k: int) -> int:
    """Bytes of memory that slice ``k`` stands for (a whole number of MiB)."""
    mib = memory_total // MIB
    return ((k + 1) * mib // slices_per_gpu - k * mib // slices_per_gpu) * MIB


def allocation_id(device_ids: Iterable[str]) -> str:
    """A stable name for a set of device IDs (order does not matter)."""
    digest = hashlib.sha256("\n".join(sorted(set(device_ids))).encode()).hexdigest()
    return f"alloc-{digest[:16]}"


@dataclass(frozen=True)
class GpuShare:
    ordinal: int  # as the container sees it: position in NVIDIA_VISIBLE_DEVICES
    index: int  # host index
    uuid: str
    slices: tuple[int, ...]
    memory_limit: int  # bytes


@dataclass(frozen=True)
class Plan:
    """What one container gets for a set of device IDs."""

    device_ids: tuple[str, ...]  # sorted
    gpus: tuple[GpuShare, ...]  # in host index order
    active_thread_percentage: float

    @property
    def allocation_id(self) -> str:
        return allocation_id(self.device_ids)

    @property
    def memory_limits(self) -> dict[int, int]:
        """Bytes per ordinal the container sees."""
        return {g.ordinal: g.memory_limit for g in self.gpus}

    @property
    def visible_devices(self) -> str:
        return ",".join(g.uuid for g in self.gpus)

    @property
    def spans_gpus(self) -> bool:
        return len(self.gpus) > 1


def plan_allocation(device_ids: Sequence[str], gpus: Sequence[GpuLike], slices_per_gpu: int) -> Plan:
    """The limits for a container holding ``device_ids``; PluginError for IDs we never advertised."""
    if not device_ids:
        raise PluginError("empty allocation: expected at least one device ID")
    by_uuid = {g.uuid: g for g in gpus}
    taken: dict[str, set[int]] = {}
    for text in device_ids:
        sid = parse_slice_id(text, slices_per_gpu)
        if sid.uuid not in by_uuid:
            raise PluginError(f"bad device ID {text!r}: GPU {sid.uuid} is not on this node")
        slices = taken.setdefault(sid.uuid, set())
        if sid.slice in slices:
            raise PluginError(f"bad allocation: device ID {text!r} given twice")
        slices.add(sid.slice)
    ordered = sorted((by_uuid[u] for u in taken), key=lambda g: g.index)
    shares = tuple(
        GpuShare(
            ordinal=ordinal,
            index=g.index,
            uuid=g.uuid,
            slices=tuple(sorted(taken[g.uuid])),
            memory_limit=sum(slice_share_bytes(g.memory_total, slices_per_gpu, k) for k in taken[g.uuid]),
        )
        for ordinal, g in enumerate(ordered)
    )
    percentage = max(thread_percentage(len(s.slices), slices_per_gpu) for s in shares)
    return Plan(tuple(sorted(device_ids)), shares, percentage)


def thread_percentage(slices: int, slices_per_gpu: int) -> float:
    """``100*k/N`` rounded to two decimals (MPS takes a decimal number in (0, 100])."""
    return round(100.0 * slices / slices_per_gpu, 2)


def preferred_allocation(
    available: Sequence[str], must_include: Sequence[str], size: int, gpu_order: Sequence[str] = ()
) -> list[str]:
    """Pick ``size`` of ``available`` for one container, as few GPUs as possible.

    1. All of ``must_include``; then the other free slices of the GPUs it touches (the GPU
       with most free slices first), because the container is already there.
    2. While slices are still missing: if some GPU can supply all of them, the best fit (the
       one left with the fewest free slices afterwards); otherwise the GPU with the most
       free slices, all of them, and go on.
    Within a GPU the lowest slice numbers go first. Ties between GPUs go to the order in
    ``gpu_order`` (host index order), then to the UUID. PluginError if it cannot be done.
    """
    if size < 0 or size > len(set(available)):
        raise PluginError(f"bad preferred allocation: size {size} with {len(set(available))} device IDs available")
    for d in (*available, *must_include):
        _loose_parse(d)  # canonical IDs only: "::1" and "::01" would be one slice twice
    avail_set = set(available)
    missing = [d for d in must_include if d not in avail_set]
    if missing:
        raise PluginError(f"bad preferred allocation: must-include device {_short(missing[0])} is not available")
    chosen: list[str] = list(dict.fromkeys(must_include))
    if len(chosen) > size:
        raise PluginError(f"bad preferred allocation: {len(chosen)} must-include devices but size {size}")
    rank = {u: i for i, u in enumerate(gpu_order)}
    free: dict[str, list[SliceId]] = {}
    for d in dict.fromkeys(available):
        if d in chosen:
            continue
        sid = _loose_parse(d)
        free.setdefault(sid.uuid, []).append(sid)
    for slices in free.values():
        slices.sort(key=lambda s: s.slice)

    def key(uuid: str) -> tuple[int, str]:
        return (rank.get(uuid, len(rank)), uuid)

    def take(uuid: str, n: int) -> None:
        chosen.extend(str(s) for s in free[uuid][:n])
        del free[uuid][:n]
        if not free[uuid]:
            del free[uuid]

    touched = {_loose_parse(d).uuid for d in chosen}
    for uuid in sorted((u for u in touched if u in free), key=lambda u: (-len(free[u]), key(u))):
        take(uuid, size - len(chosen))
    while len(chosen) < size:
        need = size - len(chosen)
        fits = [u for u in free if len(free[u]) >= need]
        if fits:
            take(min(fits, key=lambda u: (len(free[u]) - need, key(u))), need)
        else:
            take(min(free, key=lambda u: (-len(free[u]), key(u))), need)
    return chosen


def _loose_parse(text: str) -> SliceId:
    """Any GPU and slice number, but only in canonical form (see ``_slice_number``)."""
    uuid, sep, k = text.rpartition(SEPARATOR)
    number = _slice_number(k)
    if not sep or number is None:
        raise PluginError(f"bad device ID {_short(text)}: expected <GPU-uuid>::<slice> (slice 0..{MAX_SLICES - 1})")
    return SliceId(uuid, number)

