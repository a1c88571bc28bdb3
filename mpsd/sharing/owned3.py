"""Which MPS v3 namespaces mpsd made: a journal in stateDir (``mps-v3-namespaces.json``).

Reconcile deletes a namespace only when this journal says mpsd created it and no live slice
names it: a namespace of mpsd's name shape that an operator made is never touched. A name is
written (fsync, rename) before the namespace is created, so a crash between the two leaves it
known; it is removed once the daemon no longer lists the namespace. An unreadable journal is
said in the log and taken as empty: then nothing is deleted, which is the safe side.
"""

from __future__ import annotations

import json
import logging
import os
import threading

from ..alloc.state import write_atomic
from ..errors import MpsdError

log = logging.getLogger(__name__)

FILE = "mps-v3-namespaces.json"
READ_LIMIT = 4 << 20


class Owned:
    """(server, namespace) pairs mpsd created; ``path`` None keeps them in memory only."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._pairs: set[tuple[str, str]] = self._load()

    def _load(self) -> set[tuple[str, str]]:
        if not self.path:
            return set()
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return set()
        except OSError as exc:
            log.error("journal of mpsd's MPS v3 namespaces unreadable path=%s error=%s: none is deleted",
                      self.path, exc)
            return set()
        with os.fdopen(fd, "rb") as f:
            data = f.read(READ_LIMIT)
        try:
            pairs = json.loads(data)["namespaces"]
            return {(str(s), str(n)) for s, n in pairs}
        except (ValueError, KeyError, TypeError) as exc:
            log.error("journal of mpsd's MPS v3 namespaces unreadable path=%s error=%s: none is deleted",
                      self.path, exc)
            return set()

    def _save(self) -> None:
        if self.path:
            text = json.dumps({"version": 1, "namespaces": sorted(self._pairs)}, indent=0)
            try:
                write_atomic(self.path, text.encode(), 0o600)
            except (MpsdError, OSError) as exc:
                raise MpsdError(f"journal of mpsd's MPS v3 namespaces not written: {exc}") from exc

    def add(self, server: str, namespace: str) -> None:
        with self._lock:
            if (server, namespace) not in self._pairs:
                self._pairs.add((server, namespace))
                self._save()

    def discard(self, server: str, namespace: str) -> None:
        with self._lock:
            if (server, namespace) in self._pairs:
                self._pairs.discard((server, namespace))
                self._save()

    def has(self, server: str, namespace: str) -> bool:
        with self._lock:
            return (server, namespace) in self._pairs
