"""A control daemon blocked writing a FIFO of its pipe dir: contested, never hung (issue 33, row 5).

The daemon creates ``<pipeDir>/log`` (a FIFO, mode 0777) at each start, holds it open both ways
and reads it in a thread of its own: its own log lines and its servers' go through it, framed
as records, to control.log and server.log (stdout under ``-f``). Seen on every Debian version
(535.216 to 555.58): a record it cannot parse (48 bytes of zeros) ends that thread, nobody reads
the FIFO after that, and once it holds 64 KiB the daemon's next log line blocks its main thread
in ``write(2)`` for good: it answers no one. Anyone who can open the FIFO can do that (writes
pass a read-only mount; pods get /dev/null over it, but the daemon's new FIFO after a restart
detaches that bind in pods started before), and the writer need not stay: 48 bytes, then the
daemon's own lines fill it. A daemon silent this way is therefore no proof of a hang.

:func:`blocked` reads what the kernel shows: each thread's system call
(``/proc/PID/task/TID/syscall``: ``write``/``writev`` and the descriptor), that descriptor's
target (a FIFO under the pipe dir), the bytes queued in it (``FIONREAD`` on a descriptor of
mpsd's own opened ``O_RDONLY|O_NONBLOCK``: it takes nothing out, and the daemon's own read end
keeps the FIFO open whatever mpsd does) and the processes other than the daemon and its
servers holding it open for writing (``/proc/*/fd`` and ``fdinfo``), with their pod and
container. Nothing is drained: what is queued is the daemon's own records mixed with whatever
the writer sent, and a reader mpsd ran would put lines a tenant wrote into control.log.
Parsing is done by pure functions (tables in tests/daemon/test_logfifo.py).
"""

from __future__ import annotations

import fcntl
import os
import platform
import stat
import struct
import termios
from dataclasses import dataclass

from . import peer

# write(2) and writev(2) by machine (the numbers of the kernel's syscall tables)
WRITE_SYSCALLS = {"x86_64": (1, 20), "aarch64": (64, 66), "ppc64le": (4, 146), "s390x": (4, 146)}
F_GETPIPE_SZ = 1032
DELETED = " (deleted)"
NAMED = 5  # writers named in one line at most; the rest are counted


@dataclass(frozen=True)
class Blocked:
    """The daemon's threads blocked writing one FIFO of its pipe dir."""

    fifo: str  # its path, as the daemon's descriptor names it
    threads: tuple[int, ...]  # the daemon's threads in write() on it
    queued: int | None  # bytes in it (None: it could not be opened to look)
    capacity: int | None
    writers: tuple[int, ...]  # other processes holding it open for writing (not the daemon or its servers)


# ---------------------------------------------------------------- pure


def written_fd(syscall: str, machine: str | None = None) -> int | None:
    """The descriptor a thread is writing to, from its ``/proc/PID/task/TID/syscall`` text
    (``NR arg1 … sp pc``; ``running``, or ``-1 sp pc`` outside a system call); None unless it
    is in write(2) or writev(2) on ``machine`` (this one's by default)."""
    fields = syscall.split()
    calls = WRITE_SYSCALLS.get(machine or platform.machine(), ())
    if len(fields) < 2 or not fields[0].isdigit() or int(fields[0]) not in calls:
        return None
    try:
        fd = int(fields[1], 16)
    except ValueError:
        return None
    return fd if 0 <= fd < 1 << 31 else None


def opened_for_writing(fdinfo: str) -> bool:
    """True if a ``/proc/PID/fdinfo/N`` text shows the descriptor open for writing (O_WRONLY or O_RDWR)."""
    for line in fdinfo.splitlines():
        key, _, value = line.partition(":")
        if key == "flags":
            try:
                return int(value.strip(), 8) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
            except ValueError:
                return False
    return False


def under(path: str, root: str) -> bool:
    """True if ``path`` (a descriptor's target as /proc names it) lies in the directory ``root``."""
    path = path[: -len(DELETED)] if path.endswith(DELETED) else path
    return path.startswith(root.rstrip("/") + "/")


def describe(found: Blocked, names: list[str]) -> str:
    """One line: what blocks the daemon and who holds the FIFO (``names``: the writers described)."""
    queued = "" if found.queued is None else f", {found.queued} of {found.capacity} bytes queued"
    threads = ",".join(map(str, found.threads))
    more = len(names) - NAMED
    if names:
        who = "held open for writing by " + ", ".join(names[:NAMED]) + (f" and {more} more" if more > 0 else "")
    else:
        who = "no process but the daemon holds it open for writing now (the writer has gone)"
    return (f"contested, not hung: daemon thread(s) {threads} blocked writing its log FIFO {found.fifo}{queued}, "
            f"which it no longer reads (a record it could not parse was written into it); {who}")


def reason(age: float, bound: float, text: str) -> str:
    """/readyz's reason while a blocked log FIFO keeps health checks without a verdict."""
    return (f"no health verdict for {age:.0f}s (verdictTimeout {bound:g}s): {text}; the daemon is left running "
            "(docs/operations.md: a daemon blocked on its log FIFO)")


# ---------------------------------------------------------------- the kernel's view


def blocked(daemon_pid: int, pipe_dir: str, proc: str = "/proc") -> Blocked | None:
    """The daemon's threads blocked in write() on a FIFO in ``pipe_dir``; None when none is (or
    its threads cannot be read: then its sessions cannot be either, and that is inconclusive)."""
    root = os.path.realpath(pipe_dir)
    fifos: dict[tuple[int, int], tuple[str, list[int]]] = {}
    try:
        tids = sorted(int(t) for t in os.listdir(f"{proc}/{daemon_pid}/task") if t.isdigit())
    except OSError:
        return None
    for tid in tids:
        try:
            fd = written_fd(peer._read(f"{proc}/{daemon_pid}/task/{tid}/syscall", 4096).decode(errors="replace"))
            if fd is None:
                continue
            link = f"{proc}/{daemon_pid}/fd/{fd}"
            target, st = os.readlink(link), os.stat(link)
        except OSError:
            continue
        if stat.S_ISFIFO(st.st_mode) and under(target, root):
            fifos.setdefault((st.st_dev, st.st_ino), (target, []))[1].append(tid)
    if not fifos:
        return None
    (dev, ino), (target, threads) = next(iter(fifos.items()))
    queued, capacity = _queued(target, dev, ino)
    return Blocked(target, tuple(threads), queued, capacity, tuple(_writers(dev, ino, daemon_pid, proc)))


def _queued(path: str, dev: int, ino: int) -> tuple[int | None, int | None]:
    """Bytes in the FIFO at ``path`` and its capacity, read through a descriptor of mpsd's own
    (never blocking, taking nothing out); (None, None) when it is not that FIFO any more."""
    if path.endswith(DELETED):
        return None, None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None, None
    try:
        st = os.fstat(fd)
        if not stat.S_ISFIFO(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino):
            return None, None
        queued = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, bytes(4)))[0]
        return queued, fcntl.fcntl(fd, F_GETPIPE_SZ)
    except OSError:
        return None, None
    finally:
        os.close(fd)


def _writers(dev: int, ino: int, daemon_pid: int, proc: str) -> list[int]:
    """Processes holding the FIFO (dev, ino) open for writing, but the daemon, its servers (its
    children, which write their log lines into it) and mpsd."""
    found = []
    for name in os.listdir(proc):
        if not name.isdigit() or int(name) in (daemon_pid, os.getpid()):
            continue
        pid = int(name)
        if _holds_for_writing(pid, dev, ino, proc) and peer.parent_pid(pid, proc) != daemon_pid:
            found.append(pid)
    return sorted(found)


def _holds_for_writing(pid: int, dev: int, ino: int, proc: str) -> bool:
    try:
        fds = os.listdir(f"{proc}/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            st = os.stat(f"{proc}/{pid}/fd/{fd}")
            if (st.st_dev, st.st_ino) != (dev, ino):
                continue
            if opened_for_writing(peer._read(f"{proc}/{pid}/fdinfo/{fd}", 4096).decode(errors="replace")):
                return True
        except OSError:
            continue
    return False


def report(found: Blocked, proc: str = "/proc") -> str:
    """:func:`describe` with each writer named (PID, command, pod and container from its cgroup)."""
    return describe(found, [peer.describe(pid, proc) for pid in found.writers])
