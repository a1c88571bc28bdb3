"""A lock for a thread of this process and, through a file, for every other process: how two
mpsd instances of a rolling update share one state file (mpsd/alloc/state.py) and serialize
their DRA calls (mpsd/dra/kubeletplugin.py)."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time

from ..errors import PluginError

log = logging.getLogger(__name__)

LOCK_WAIT = 20.0  # seconds another process may hold a lock (it does for one change or one call)


class SharedLock:
    """Re-entrant within the process (an RLock), exclusive across processes (flock on ``path``)
    while held; ``on_acquire`` runs each time a thread takes it first (not when it re-enters).
    A lock file that cannot be opened (a read-only directory) leaves the process-local lock:
    logged once; a lock another process holds longer than ``wait`` seconds is a PluginError."""

    def __init__(self, path: str, on_acquire=lambda: None, wait: float = LOCK_WAIT) -> None:
        self.path, self.on_acquire, self.wait = path, on_acquire, wait
        self._rlock = threading.RLock()
        self._depth = 0
        self._fd: int | None = None
        self._warned = False

    def __enter__(self) -> "SharedLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> bool:
        self._rlock.acquire()
        if self._depth == 0:
            try:
                self._lock_file()
                self._depth = 1
                self.on_acquire()
            except BaseException:
                self._depth = 0
                self._unlock_file()
                self._rlock.release()
                raise
        else:
            self._depth += 1
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._unlock_file()
        self._rlock.release()

    def _lock_file(self) -> None:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            if not self._warned:
                log.warning("state lock file unusable, this process alone is guarded path=%s error=%s",
                            self.path, exc.strerror or exc)
                self._warned = True
            return
        deadline = time.monotonic() + self.wait
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise PluginError(f"state lock {self.path} held by another process for {self.wait:g}s") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            except OSError as exc:
                os.close(fd)
                raise PluginError(f"cannot lock {self.path}: {exc.strerror or exc}") from exc
        self._fd = fd

    def _unlock_file(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases its flock
            self._fd = None
