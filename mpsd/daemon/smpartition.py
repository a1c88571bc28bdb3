"""Static SM partitions (CUDA 13.1+): a slice of a MIG instance gets SMs of its own instead of a
share of the instance's threads.

NVIDIA's MPS documentation (Legacy MPS v2 Interface; Common Tasks): a control daemon started with
``-S`` / ``--static-partitioning`` carves its devices' SMs into partitions of whole chunks
(``sm_partition add <device UUID> <chunks>``, ``sm_partition rm <device UUID> <partition>``,
``lspart``); a client names its partition in ``CUDA_MPS_SM_PARTITION`` before CUDA starts, and
runs on those SMs only; from driver r610 clients of other partitions are isolated from
SM-triggered faults ("partial error isolation"). The mode is the daemon's: every client of it
needs a partition, and thread percentages are not used. A chunk is 8 SMs on Hopper and later
data-center GPUs, 4 before (NVIDIA's "Static SM Partitioning" section as its users quote it).

mpsd offers it per MIG profile (``mig.smPartitionProfiles``): the daemons of those instances run
with ``-S``, and each slice's compute becomes a partition of the instance's chunks (at least one,
rounded down) created when the slice is granted and removed when it is released. A claim that
wants compute isolation rather than a thread cap asks for such a profile (device plugin) or
selects ``smPartitions == true`` (DRA). Where the control binary has no static partitioning (the
words ``sm_partition`` and ``static-partitioning`` are not in it, as in every driver before CUDA
13.1), ``mpsd run`` refuses the setting in one line.

Trade-off (docs/mig.md): a partition is a reservation, so SMs a slice leaves idle are not lent to
its neighbours (a thread cap lets each client use up to its share of whatever is free); chunks are
coarse (a 1g instance of an H100 has 2); a daemon restart loses every partition, so a slice's
partition is created again under a new ID and its pods must be started again to use it.
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
from typing import Callable

from ..errors import BackendError, ControlError

log = logging.getLogger(__name__)

MARKERS = (b"sm_partition", b"static-partitioning")
MAX_BINARY_BYTES = 256 << 20
_ID = re.compile(r"(?:GPU|MIG)-[0-9A-Za-z-]+/[^\s]+")


def binary_support(binary: str) -> tuple[bool, str]:
    """(the control binary has static SM partitioning, what was found), from the binary's own bytes
    (the command words its front-end and daemon know, as ``strings`` shows them)."""
    path = shutil.which(binary)
    if path is None:
        return False, f"control binary {binary!r} not found"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BINARY_BYTES)
    except OSError as exc:
        return False, f"cannot read {path}: {exc.strerror}"
    missing = [m.decode() for m in MARKERS if m not in data]
    if missing:
        return False, f"{path} has no {' or '.join(missing)} in it (static SM partitioning came with CUDA 13.1)"
    return True, f"{path} has sm_partition and --static-partitioning"


def chunk_sms(compute_capability: tuple[int, int]) -> int:
    return 8 if compute_capability >= (9, 0) else 4


def chunks_for(percent: float, sm_count: int, compute_capability: tuple[int, int]) -> int:
    """The chunks of a slice of ``percent`` of an instance: rounded down, at least one."""
    total = sm_count // chunk_sms(compute_capability)
    return max(1, min(total, int(total * percent / 100)))


def parse_created(output: str) -> str | None:
    """The partition ID ``sm_partition add`` printed (``Partition <UUID>/<id> created`` or the bare
    ``<UUID>/<id>``), None when it printed none (a refusal)."""
    match = _ID.search(output)
    return match.group(0) if match else None


class Partitions:
    """The partitions of the slices of static instances: key -> (instance UUID, daemon pid, ID).
    ``control(uuid)`` is the instance daemon's front-end (mpsd.daemon.control.Control), ``pid(uuid)`` its
    current daemon: a partition made under another daemon is gone and made again."""

    def __init__(self, control: Callable[[str], object], pid: Callable[[str], int | None]) -> None:
        self._control, self._pid = control, pid
        self._made: dict[str, tuple[str, int | None, str]] = {}
        self._lock = threading.Lock()

    def ensure(self, key: str, uuid: str, chunks: int) -> str:
        """The ID of ``key``'s partition of ``chunks`` on ``uuid``, made now if it has none on the
        running daemon; BackendError (one line) when the daemon refuses."""
        with self._lock:
            pid = self._pid(uuid)
            made = self._made.get(key)
            if made is not None and made[0] == uuid and made[1] == pid:
                return made[2]
            command = f"sm_partition add {uuid} {chunks}"
            try:
                out = self._control(uuid).call(command)  # type: ignore[attr-defined]
            except ControlError as exc:
                raise BackendError(f"{key}: {command} failed: {exc}") from exc
            part = parse_created(out)
            if part is None:
                said = " ".join(out.split())[:200] or "nothing"
                raise BackendError(f"{key}: {command} made no partition (the daemon said {said!r}): the instance "
                                   "has fewer free chunks than the slice needs, or no static partitioning")
            self._made[key] = (uuid, pid, part)
            log.info("SM partition made key=%s instance=%s chunks=%d partition=%s", key, uuid, chunks, part)
            return part

    def release(self, key: str) -> None:
        with self._lock:
            made = self._made.pop(key, None)
            if made is None:
                return
            uuid, pid, part = made
            if pid is None or pid != self._pid(uuid):
                return  # made under a daemon that is gone: gone with it
            try:
                self._control(uuid).call(f"sm_partition rm {uuid} {part}")  # type: ignore[attr-defined]
            except ControlError as exc:
                log.warning("SM partition not removed key=%s partition=%s error=%s", key, part, exc)
