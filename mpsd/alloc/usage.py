"""What a region file says is in use: the shim's accounting read for the metrics of every face
(the device plugin's allocations, DRA's claims, ``mpsd exec``'s regions)."""

from __future__ import annotations

import os
from typing import Callable, Mapping

UsageReader = Callable[[str], Mapping[int, int]]  # region file -> bytes used per ordinal


def shim_usage(region_path: str, library: str | None = None) -> dict[int, int]:
    """Bytes in use per device ordinal in a shim region, read through ``library`` (default:
    shim.library_path()); {} when no process created the region yet. The region is a pod's
    file: shim.usage refuses a symlink, a FIFO or an oversized file without opening it, and
    reads a private copy of it."""
    if not os.path.lexists(region_path):  # lexists: a symlink is refused by shim.usage, not skipped
        return {}
    import shim  # the interposer's Python side; imported late so the plugin starts without it

    # copy: the plugin runs inside mpsd, and a pod truncating its region while a mapping of it
    # is read would kill mpsd (and the node's MPS daemon with it) with SIGBUS
    return {int(d.device): int(d.used) for d in shim.usage(region_path, library=library, copy=True)}
