"""The control daemon's log files in logDir, kept to a size.

``mpsd run`` and ``mpsd holder`` start the daemon in the foreground (``-f``): it writes nothing
itself, every line (its servers' too) comes on its standard output and LogFile appends it to
control.log, rotating by renaming (control.log -> control.log.1 -> ... -> control.log.KEEP) when
the next line would take it past ``logMaxSize``. A daemon started detached (``-d``, by an
earlier mpsd or by hand) opens control.log and server.log itself, with O_APPEND (seen with
535.216, 550.163 and 555.58 in /proc/PID/fdinfo): mpsd supervising it copies the newest
``logMaxSize`` bytes to ``<file>.1`` and truncates the file in place (rotate_held), and the
daemon's next line lands at the start. Lines the daemon writes between the copy and the
truncation are lost, as with logrotate's copytruncate.

logDir may be left writable to others by a careless setup: nothing here follows a link, and
only regular files are read, written or truncated.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time

from ..logs import OncePerKey

log = logging.getLogger(__name__)

HELD_NAMES = ("control.log", "server.log")  # what a detached daemon opens in CUDA_MPS_LOG_DIRECTORY
COPY_CHUNK = 1 << 20


def shift(path: str, keep: int) -> None:
    """``path`` becomes ``path.1``, ``path.1`` becomes ``path.2`` ... up to ``path.KEEP``, and
    the oldest is replaced; with ``keep`` 0 ``path`` is removed. A link is moved, never followed."""
    if keep == 0:
        os.unlink(path)
        return
    _shift_rotated(path, keep)
    os.rename(path, f"{path}.1")


def _shift_rotated(path: str, keep: int) -> None:
    for i in range(keep - 1, 0, -1):
        try:
            os.rename(f"{path}.{i}", f"{path}.{i + 1}")
        except FileNotFoundError:
            pass


def copy_truncate(path: str, max_size: int, keep: int) -> bool:
    """If the regular file ``path`` is over ``max_size`` bytes: its newest ``max_size`` bytes, from
    the first whole line among them, to ``path.1`` (older copies shifted, see shift), then
    ``path`` truncated to 0. True if it was. A copy that cannot be kept (a full disk, a quota)
    does not keep the file from being truncated: the old lines are lost, never the disk; the
    OSError is raised afterwards, saying so."""
    fd, info = _open_regular(path, os.O_RDWR)
    try:
        if info.st_size <= max_size:
            return False
        lost = None
        try:
            if keep:
                _keep_tail(fd, path, info.st_size, max_size, keep)
        except OSError as exc:
            lost = exc
        os.ftruncate(fd, 0)
        if lost is not None:
            reason = lost.strerror or str(lost)
            raise OSError(lost.errno, f"{reason}: truncated without a copy, its last lines are lost", path)
        return True
    finally:
        os.close(fd)


def _keep_tail(fd: int, path: str, size: int, max_size: int, keep: int) -> None:
    copy = _copy_tail(fd, size, max_size, f"{path}.1.tmp")
    try:  # the kept copies move on only once the new one is whole
        _shift_rotated(path, keep)
        os.rename(copy, f"{path}.1")
    except OSError:
        _unlink(copy)
        raise


def _open_regular(path: str, flags: int) -> tuple[int, os.stat_result]:
    """``path`` opened with ``flags``, never through a link nor waiting on a FIFO, and its
    stat; OSError (EINVAL) for anything but a regular file."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd, info


def _copy_tail(fd: int, size: int, count: int, tmp: str) -> str:
    """The last ``count`` bytes of the first ``size`` of ``fd`` to a new file ``tmp`` (one left by
    a copy cut short is replaced; a link is removed, not followed); ``tmp``. OSError, and no
    ``tmp``, when they cannot all be written (a full disk, a quota)."""
    _unlink(tmp)
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            offset = _line_start(fd, max(0, size - count), size)
            while offset < size:
                chunk = os.pread(fd, min(COPY_CHUNK, size - offset), offset)
                if not chunk:
                    break
                written = os.write(out, chunk)  # short on a disk that fills up: the rest is tried again
                offset += written
        finally:
            os.close(out)
    except OSError:
        _unlink(tmp)
        raise
    return tmp


def _line_start(fd: int, offset: int, size: int) -> int:
    """``offset``, or where the first whole line from it starts (a copy begins with no half line),
    if a line ends within COPY_CHUNK bytes of it and before ``size``."""
    if offset == 0:
        return 0
    ahead = os.pread(fd, min(COPY_CHUNK, size - offset + 1), offset - 1)
    end = ahead.find(b"\n")
    return offset if end < 0 or offset + end >= size else offset + end


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def held_by(pid: int, log_dir: str, names: tuple[str, ...] = HELD_NAMES) -> list[str]:
    """The files among ``log_dir/<names>`` that process ``pid`` holds open (its /proc/PID/fd):
    those it writes itself. [] if it holds none or is gone."""
    wanted = {os.path.join(os.path.realpath(log_dir), name) for name in names}
    held: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target in wanted:
            held.add(target)
    return sorted(held)


def rotate_held(pid: int, log_dir: str, max_size: int, keep: int) -> list[str]:
    """copy_truncate each log file the daemon ``pid`` writes itself (held_by) that is over
    ``max_size``; the files rotated. OSError from one file is raised after the others are done."""
    if not max_size:
        return []
    rotated, failure = [], None
    for path in held_by(pid, log_dir):
        try:
            if copy_truncate(path, max_size, keep):
                rotated.append(path)
        except OSError as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
    return rotated


class HeldLogs:
    """The logs a detached daemon writes itself, kept to ``max_size`` from a thread of their own
    (independent.AdoptedDaemon's watcher): their size is looked at every CHECK_EVERY seconds,
    far more often than the health interval (a flood of ~300 MB/s reaches no more than that
    much past the size), and which files the daemon holds every LIST_EVERY seconds. Each
    failure is said once."""

    CHECK_EVERY = 0.2
    LIST_EVERY = 2.0

    def __init__(self, log_dir: str, max_size: int, keep: int) -> None:
        self.log_dir, self.max_size, self.keep = log_dir, max_size, keep
        self._paths: list[str] = []
        self._listed_at = -self.LIST_EVERY
        self._said = OncePerKey(16)

    def check(self, pid: int) -> None:
        """Rotate (copy_truncate) each log of the daemon ``pid`` that is over the size."""
        if not self.max_size:
            return
        if time.monotonic() - self._listed_at >= self.LIST_EVERY:
            self._paths, self._listed_at = held_by(pid, self.log_dir), time.monotonic()
        for path in self._paths:
            try:
                if copy_truncate(path, self.max_size, self.keep):
                    log.info("daemon log rotated path=%s (copied to .1 and truncated: the daemon writes it)", path)
            except OSError as exc:
                if self._said.first(str(exc)):
                    log.warning("cannot rotate the daemon's log in %s: %s", self.log_dir, exc)


class LogFile:
    """control.log, appended to line by line, and rotated (shift) when the next line would take
    it past ``max_size`` bytes (0: never). A line that cannot be written (a full disk, the
    directory gone) is dropped and counted, and the next line tries again (the file reopened at
    most every REOPEN_EVERY seconds): writing resumes once there is space, with a line saying
    how many were lost. Opened without following links; anything but a regular file is refused.
    A rotation that fails is said once and tried again ROTATE_RETRY seconds later, the lines
    going on to the file meanwhile. A file removed or moved away by someone else (``rm``, an
    outside logrotate) is created again when the size is reached, rather than grown out of sight."""

    REOPEN_EVERY = 1.0
    ROTATE_RETRY = 60.0

    def __init__(self, path: str, max_size: int = 0, keep: int = 3) -> None:
        self.path, self.max_size, self.keep = path, max_size, keep
        self.dropped = 0
        self.rotations = 0
        self._fd: int | None = None
        self._size = 0  # bytes in the open file, as far as this writer knows
        self._reopen_at = 0.0
        self._rotate_at = 0.0  # a failed rotation is tried again from then on
        self._failure = ""  # why lines are being dropped, "" while writing works
        self._partial = False  # the last failed write left half a line in the file

    def write(self, line: bytes) -> bool:
        """True if ``line`` reached the file."""
        try:
            fd = self._open()
            if self.max_size and self._size and self._size + len(line) > self.max_size:
                fd = self._rotate(fd)
            if self._failure:
                note = f"mpsd: {self.dropped} line(s) of the control daemon's output lost: {self._failure}\n"
                self._write_all(fd, (b"\n" if self._partial else b"") + note.encode())
            self._write_all(fd, line)
        except OSError as exc:
            self._dropped(exc)
            return False
        if self._failure:
            log.warning("control log written again path=%s lost_lines=%d", self.path, self.dropped)
            self._failure, self.dropped = "", 0
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open(self) -> int:
        if self._fd is not None:
            return self._fd
        if time.monotonic() < self._reopen_at:
            raise OSError(errno.EAGAIN, self._failure or "waiting to reopen")
        self._reopen_at = time.monotonic() + self.REOPEN_EVERY
        fd, info = _open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self._fd, self._size = fd, info.st_size
        return fd

    def _rotate(self, fd: int) -> int:
        now = time.monotonic()
        if now < self._rotate_at:
            return fd
        if not self._at_path(fd):  # removed or moved away by someone else: a new file there, nothing shifted
            return self._reopen()
        try:
            shift(self.path, self.keep)
        except OSError as exc:
            self._rotate_at = now + self.ROTATE_RETRY
            log.warning("cannot rotate control log path=%s error=%s: appending to it, trying again in %gs",
                        self.path, exc.strerror or exc, self.ROTATE_RETRY)
            return fd
        self.rotations += 1
        return self._reopen()

    def _reopen(self) -> int:
        self.close()
        self._reopen_at = 0.0
        return self._open()

    def _at_path(self, fd: int) -> bool:
        """False if ``fd`` is no longer the file at ``path`` (removed, renamed, replaced)."""
        try:
            there = os.lstat(self.path)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # shift says why
        held = os.fstat(fd)
        return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)

    def _write_all(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(fd, view)
            except OSError:
                self._partial = len(view) < len(data)
                raise
            view = view[written:]
            self._size += written
        self._partial = False

    def _dropped(self, exc: OSError) -> None:
        self.dropped += 1
        if exc.errno == errno.EAGAIN:
            return  # not reopened yet: already reported
        reason = exc.strerror or str(exc)
        if not self._failure:
            log.warning("cannot write control log path=%s error=%s: dropping lines until it works", self.path, reason)
        self._failure = reason
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            self.close()  # reopen later: the file or its directory may be back
