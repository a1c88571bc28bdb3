"""Guaranteed + burst for the device plugin (config ``devicePlugin.memoryLimit``). Pure.

A container's slices are its guarantee (the soft limit, what it always gets); ``memoryLimit``
is the hard limit it may reach by borrowing memory other slices leave idle, taken back under
pressure (docs/mps-v3.md). Never below the guarantee: a container with more slices than the
limit stands for keeps its slices' memory."""

from __future__ import annotations

from typing import Callable, Sequence

from ..errors import PluginError
from ..alloc.slicing import MIB, GpuLike, Plan
from ..units import format_size_mps_control, parse_size


def burst_limits(memory_limit: str, gpus: Sequence[GpuLike]) -> Callable[[Plan], dict[int, int]]:
    """plan -> {ordinal: hard bytes}; PluginError (one line) for a size above a GPU's memory."""
    if not memory_limit:
        return lambda plan: {}
    totals = {g.uuid: g.memory_total for g in gpus}
    if memory_limit.endswith("%"):
        share = float(memory_limit[:-1]) / 100

        def value(uuid: str) -> int:
            return int(totals[uuid] * share) // MIB * MIB
    else:
        size = parse_size(memory_limit)
        for g in gpus:
            if size > g.memory_total:
                raise PluginError(f"devicePlugin.memoryLimit {memory_limit} is above GPU {g.index}'s "
                                  f"{format_size_mps_control(g.memory_total)}: expected at most the smallest GPU")

        def value(uuid: str) -> int:
            return size

    return lambda plan: {g.ordinal: max(g.memory_limit, value(g.uuid)) for g in plan.gpus if g.uuid in totals}
