"""The plugin's live allocations on disk, so a restarted plugin still knows them.

A snapshot (one JSON file, replaced atomically: a temporary file in the same directory,
fsync, rename, fsync the directory) plus an append-only journal of the changes since
(one JSON line per change, fdatasync'd before the change returns). See ``StateStore``.

Two mpsd processes may share one state file for a while: during a rolling update the old and
the new instance of the DaemonSet's pod serve the kubelet side by side (docs/operations.md).
The store's lock is therefore also a file lock (``<path>.lock``, flock) across processes, and
whoever takes it first reads again what another process wrote since (the snapshot or the
journal changed under it), so a change is never made to, nor a snapshot written from, a stale
copy. The wait for it is bounded (LOCK_WAIT seconds): a PluginError names the lock file.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Generic, Iterable, Protocol, TypeVar, overload

from ..errors import PluginError
from .sharedlock import SharedLock

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
JOURNAL_SUFFIX = ".journal"
LOCK_SUFFIX = ".lock"


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


class Record(Protocol):
    """What a StateStore keeps: a frozen record with an ID, a creation time and JSON."""

    @property
    def allocation_id(self) -> str: ...
    @property
    def created(self) -> float: ...
    def to_json(self) -> dict: ...
    @classmethod
    def from_json(cls, data: dict) -> Any: ...


R = TypeVar("R", bound=Record)


class StateStore(Generic[R]):
    """Allocations by ID, on disk before every change returns. Thread-safe.

    ``lock`` (re-entrant) is held by every method; hold it yourself to make a read, a
    decision and a write one step (Allocate recording, garbage collection releasing).

    On disk: a snapshot at ``path`` (replaced atomically by ``compact``) and a journal at
    ``path + ".journal"``: each change appends one JSON line and fdatasyncs it, one small
    durable write on Allocate's path instead of a whole new file with two fsyncs. Loading
    reads the snapshot, then replays the journal; a line cut short by a crash (the last
    one) is dropped, as its change never returned. Replaying is idempotent: a journal left
    behind by a crash between a snapshot and its truncation replays to that snapshot."""

    @overload
    def __init__(self: StateStore[Allocation], path: str, compact_every: int = 4096) -> None: ...
    @overload
    def __init__(self, path: str, compact_every: int = 4096, *, record: type[R]) -> None: ...

    def __init__(self, path: str, compact_every: int = 4096, record: type = Allocation) -> None:
        self.path = path
        # what is stored: Allocation for the device plugin, mpsd.dra.prepared.PreparedClaim for DRA;
        # any frozen record with allocation_id, created, to_json() and from_json()
        self.record: type[R] = record
        self.journal_path = path + JOURNAL_SUFFIX
        self.compact_every = compact_every  # journal lines that make a write compact at once
        self.lock = SharedLock(path + LOCK_SUFFIX, self._refresh)
        self._allocations: dict[str, R] = {}
        self._journal_fd: int | None = None
        self._journal_size = 0
        self.journal_lines = 0
        self._seen: tuple | None = None  # the files as this store last read or wrote them (None: not loaded)

    def load(self, quiet: bool = False) -> dict[str, R]:
        """Read the snapshot and replay the journal. A damaged snapshot is moved aside and
        reported, not fatal; a damaged journal line ends the replay, the journal is moved aside."""
        with self.lock:
            self.close()  # a journal moved aside is not written on
            try:
                with open(self.path, encoding="utf-8") as f:
                    data = json.load(f)
                if data.get("version") != FORMAT_VERSION:
                    raise ValueError(f"version {data.get('version')!r}, expected {FORMAT_VERSION}")
                allocations = [self.record.from_json(a) for a in data["allocations"]]
            except FileNotFoundError:
                allocations = []
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                # RecursionError: deep nesting; ValueError also covers bad UTF-8 and huge integers
                aside = self._move_aside()
                reason = " ".join(str(exc).split())[:200]
                log.error("state file unreadable path=%s error=%s kept_as=%s", self.path, reason, aside)
                allocations = []
            self._allocations = {a.allocation_id: a for a in allocations}
            replayed = self._replay()
            self.journal_lines = replayed
            self._seen = self._files()
            log.log(
                logging.DEBUG if quiet else logging.INFO,
                "state loaded path=%s allocations=%d journal_lines=%d", self.path, len(self._allocations), replayed,
            )
            return dict(self._allocations)

    def _files(self) -> tuple:
        """(inode, size, mtime) of the snapshot and the journal: another process's write changes them."""
        out: list[tuple[int, int, int] | None] = []
        for path in (self.path, self.journal_path):
            try:
                st = os.lstat(path)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def _refresh(self) -> None:
        """Read the files again if another process changed them since this store last did
        (called with the lock just taken). Before the first load there is nothing to refresh."""
        if self._seen is not None and self._files() != self._seen:
            log.info("state changed by another process, read again path=%s", self.path)
            self.load(quiet=True)

    def _replay(self) -> int:
        try:
            with open(self.journal_path, "rb") as f:
                content = f.read()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            log.error("state journal unreadable path=%s error=%s", self.journal_path, exc.strerror or exc)
            return 0
        lines = content.split(b"\n")
        complete, tail = lines[:-1], lines[-1]  # tail: b"" or a line a crash cut short
        for n, line in enumerate(complete):
            try:
                self._apply(json.loads(line))
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                reason = " ".join(str(exc).split())[:200]
                aside = _move_aside(self.journal_path)  # the next compaction would empty it
                log.error("state journal line unreadable path=%s line=%d error=%s (later lines ignored) kept_as=%s",
                          self.journal_path, n + 1, reason, aside)
                return n
        if tail:
            log.warning("state journal ends in a partial line (a crash while writing) path=%s", self.journal_path)
        return len(complete)

    def _apply(self, entry: dict) -> None:
        if "put" in entry:
            for a in [self.record.from_json(x) for x in entry["put"]]:
                self._allocations[a.allocation_id] = a
        elif "remove" in entry:
            for i in entry["remove"]:
                self._allocations.pop(str(i), None)
        else:
            raise ValueError(f"unknown entry {sorted(entry)!r}")

    def _move_aside(self) -> str:
        return _move_aside(self.path)

    def all(self) -> list[R]:
        with self.lock:
            return sorted(self._allocations.values(), key=lambda a: (a.created, a.allocation_id))

    def get(self, allocation_id: str) -> R | None:
        with self.lock:
            return self._allocations.get(allocation_id)

    def put(self, allocation: R) -> None:
        self.put_many([allocation])

    def put_many(self, allocations: Iterable[R]) -> None:
        with self.lock:
            items = list(allocations)
            self._append({"put": [a.to_json() for a in items]})
            for a in items:
                self._allocations[a.allocation_id] = a
            self._compact_if_long()

    def remove(self, allocation_ids: Iterable[str]) -> list[R]:
        with self.lock:
            gone = [self._allocations[i] for i in dict.fromkeys(allocation_ids) if i in self._allocations]
            if gone:
                self._append({"remove": [a.allocation_id for a in gone]})
                for a in gone:
                    del self._allocations[a.allocation_id]
                self._compact_if_long()
            return gone

    def _compact_if_long(self) -> None:
        """Compact a long journal. The change that made it long is durable already (its line
        is in the journal), so a failed compaction (a full disk) does not undo or fail it: one
        line, and the next change or usage round tries again."""
        if self.journal_lines >= self.compact_every:
            try:
                self.compact()
            except PluginError as exc:
                log.warning("state compaction failed, the journal keeps every change error=%s", exc)

    def compact(self) -> None:
        """Write the snapshot (atomically) and empty the journal. Off Allocate's path: at
        start, from the usage round, or when the journal reaches ``compact_every`` lines."""
        with self.lock:
            data = {"version": FORMAT_VERSION, "allocations": [a.to_json() for a in self._allocations.values()]}
            write_atomic(self.path, json.dumps(data, indent=1, sort_keys=True).encode())
            try:
                fd = self._journal()
                os.ftruncate(fd, 0)
                os.fsync(fd)
            except OSError as exc:
                raise PluginError(f"cannot empty {self.journal_path}: {exc.strerror or exc}") from exc
            self._journal_size = 0
            self.journal_lines = 0
            self._seen = self._files()

    def close(self) -> None:
        with self.lock:
            if self._journal_fd is not None:
                os.close(self._journal_fd)
                self._journal_fd = None

    def _append(self, entry: dict) -> None:
        """One line, durable before the change is made in memory (and before Allocate answers).
        A failed write (a full disk) is cut off again, so the journal never holds half a line."""
        line = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode() + b"\n"
        try:
            fd = self._journal()
            try:
                if os.write(fd, line) != len(line):  # O_APPEND; short only when the disk is full
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.fdatasync(fd)
            except OSError:
                os.ftruncate(fd, self._journal_size)
                raise
        except OSError as exc:
            raise PluginError(f"cannot write {self.journal_path}: {exc.strerror or exc}") from exc
        self._journal_size += len(line)
        self.journal_lines += 1
        if self._seen is not None:
            self._seen = self._files()

    def _journal(self) -> int:
        """The journal's descriptor, opened once; a line a crash cut short is cut off first, so
        that the next line starts on a line of its own."""
        if self._journal_fd is not None:
            return self._journal_fd
        directory = os.path.dirname(os.path.abspath(self.journal_path))
        os.makedirs(directory, exist_ok=True)
        created = not os.path.lexists(self.journal_path)
        fd = os.open(self.journal_path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size:
                with open(self.journal_path, "rb") as f:
                    content = f.read()
                keep = content.rfind(b"\n") + 1
                if keep != size:
                    os.ftruncate(fd, keep)
                    os.fsync(fd)
                    size = keep
            if created:  # the new name itself must survive a crash
                dir_fd = os.open(directory, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except BaseException:
            os.close(fd)
            raise
        self._journal_fd = fd
        self._journal_size = size
        return fd


def _move_aside(path: str) -> str:
    """Rename a damaged file to ``<path>.bad`` (``.bad.<ns>`` if that exists already): nothing
    is lost, and the next write starts a good file. The new name, or why not."""
    aside = f"{path}.bad"
    if os.path.lexists(aside):
        aside = f"{path}.bad.{time.time_ns()}"
    try:
        os.rename(path, aside)
    except OSError as exc:
        return f"(not moved: {exc.strerror or exc})"
    return aside


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
