"""The plugin's live allocations on disk, so a restarted plugin still knows them.

One JSON file, replaced atomically (write a temporary file in the same directory, fsync,
rename, fsync the directory): a crash leaves the old or the new file, never half of one.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Iterable

from ..errors import PluginError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Allocation:
    allocation_id: str
    device_ids: tuple[str, ...]
    gpus: tuple[str, ...]  # UUIDs in the order the container sees them (ordinal 0, 1, ...)
    memory_limits: dict[int, int]  # ordinal -> bytes
    active_thread_percentage: float
    region_dir: str
    created: float  # seconds since the epoch, first Allocate of these device IDs
    pod: str = ""
    namespace: str = ""
    container: str = ""
    allocated: float = 0.0  # last Allocate of these device IDs (0: same as created)

    def to_json(self) -> dict:
        data = asdict(self)
        data["device_ids"] = list(self.device_ids)
        data["gpus"] = list(self.gpus)
        data["memory_limits"] = {str(k): v for k, v in self.memory_limits.items()}
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Allocation":
        return cls(
            allocation_id=str(data["allocation_id"]),
            device_ids=tuple(data["device_ids"]),
            gpus=tuple(data["gpus"]),
            memory_limits={int(k): int(v) for k, v in data["memory_limits"].items()},
            active_thread_percentage=float(data["active_thread_percentage"]),
            region_dir=str(data["region_dir"]),
            created=float(data["created"]),
            pod=str(data.get("pod", "")),
            namespace=str(data.get("namespace", "")),
            container=str(data.get("container", "")),
            allocated=float(data.get("allocated", 0.0)),
        )

    @property
    def last_allocated(self) -> float:
        return max(self.created, self.allocated)

    def labelled(self, pod: str, namespace: str, container: str) -> "Allocation":
        return replace(self, pod=pod, namespace=namespace, container=container)


class StateStore:
    """Allocations by ID, mirrored to ``path`` on every change. Thread-safe.

    ``lock`` (re-entrant) is held by every method; hold it yourself to make a read, a
    decision and a write one step (Allocate recording, garbage collection releasing)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.RLock()
        self._allocations: dict[str, Allocation] = {}

    def load(self) -> dict[str, Allocation]:
        """Read ``path`` if it exists. A damaged file is kept aside and reported, not fatal."""
        with self.lock:
            try:
                with open(self.path, encoding="utf-8") as f:
                    data = json.load(f)
                if data.get("version") != FORMAT_VERSION:
                    raise ValueError(f"version {data.get('version')!r}, expected {FORMAT_VERSION}")
                allocations = [Allocation.from_json(a) for a in data["allocations"]]
            except FileNotFoundError:
                allocations = []
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                # RecursionError: deep nesting; ValueError also covers bad UTF-8 and huge integers
                aside = self._move_aside()
                reason = " ".join(str(exc).split())[:200]
                log.error("state file unreadable path=%s error=%s kept_as=%s", self.path, reason, aside)
                allocations = []
            self._allocations = {a.allocation_id: a for a in allocations}
            log.info("state loaded path=%s allocations=%d", self.path, len(self._allocations))
            return dict(self._allocations)

    def _move_aside(self) -> str:
        """Rename the damaged file to ``<path>.bad`` (``.bad.<ns>`` if that exists already):
        nothing is lost, and the next write starts a good file. The new name, or why not."""
        aside = f"{self.path}.bad"
        if os.path.lexists(aside):
            aside = f"{self.path}.bad.{time.time_ns()}"
        try:
            os.rename(self.path, aside)
        except OSError as exc:
            return f"(not moved: {exc.strerror or exc})"
        return aside

    def all(self) -> list[Allocation]:
        with self.lock:
            return sorted(self._allocations.values(), key=lambda a: (a.created, a.allocation_id))

    def get(self, allocation_id: str) -> Allocation | None:
        with self.lock:
            return self._allocations.get(allocation_id)

    def put(self, allocation: Allocation) -> None:
        with self.lock:
            self._allocations[allocation.allocation_id] = allocation
            self._write()

    def put_many(self, allocations: Iterable[Allocation]) -> None:
        with self.lock:
            for a in allocations:
                self._allocations[a.allocation_id] = a
            self._write()

    def remove(self, allocation_ids: Iterable[str]) -> list[Allocation]:
        with self.lock:
            gone = [self._allocations.pop(i) for i in list(allocation_ids) if i in self._allocations]
            if gone:
                self._write()
            return gone

    def _write(self) -> None:
        data = {"version": FORMAT_VERSION, "allocations": [a.to_json() for a in self._allocations.values()]}
        write_atomic(self.path, json.dumps(data, indent=1, sort_keys=True).encode())


def write_atomic(path: str, content: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``content``: tmp file in the same directory, fsync, rename."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(content)
                f.flush()
                os.fchmod(f.fileno(), mode)
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise PluginError(f"cannot write {path}: {exc.strerror or exc}") from exc


def install_file(source: str, dest_dir: str, name: str, mode: int = 0o755) -> str:
    """Copy ``source`` to ``dest_dir/name`` atomically (a reader sees the old or the new file)."""
    try:
        with open(source, "rb") as f:
            content = f.read()
    except OSError as exc:
        raise PluginError(f"cannot read {source}: {exc.strerror or exc}") from exc
    dest = os.path.join(dest_dir, name)
    write_atomic(dest, content, mode)
    return dest
