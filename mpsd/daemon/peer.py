"""Who is behind the MPS pipe directory's sockets, and who may be treated as an MPS client.

The pipe directory is writable by GPU pods, and its sockets are found by name: a root process
in a pod can rename its own sockets over ``control_privileged`` and ``control`` and answer
in the daemon's place. mpsd therefore asks the kernel, not the answers:

- :func:`impostor` connects to each socket and reads ``SO_PEERCRED``: for a unix socket it
  names the process that called ``listen()`` (set by the kernel, not forgeable by the
  listener). Anything but the daemon mpsd started is an impostor.
- :func:`sessions` / :func:`session_holders` / :func:`session_peers` find the sessions held on
  the daemon's control sockets from the daemon's own accepted sockets, duplicated with
  ``pidfd_getfd``: a session is held while its peer is still connected (no ``POLLHUP`` or
  ``POLLRDHUP`` on the daemon's end), whoever holds it now. ``SO_PEERCRED`` only names the
  process that connected (it may have passed the socket on and exited). When the daemon's
  descriptors cannot be read (no ``CAP_SYS_PTRACE`` over a daemon that is not mpsd's child,
  Yama), :func:`sessions` says so rather than "none": the caller cannot conclude.
- :func:`mps_client_problem` is the proof asked before mpsd signals a process the daemon
  listed as a client: its environment names this pipe dir and it maps a CUDA driver.

Parsing is done by pure functions (tables in tests/daemon/test_peer.py).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import select
import socket
import struct
from dataclasses import dataclass

CONTROL_SOCKETS = ("control_privileged", "control")  # root's front-end, everyone else's
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"  # where a client looks without CUDA_MPS_PIPE_DIRECTORY
PROBE_TIMEOUT = 1.0  # seconds for one connect()
READ_LIMIT = 1 << 20  # bytes read of one /proc file (environ, cgroup, comm)
MAPS_LIMIT = 16 << 20  # bytes of /proc/PID/maps scanned for a CUDA driver
SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture


# ---------------------------------------------------------------- pure parsing


def environ_get(data: bytes, name: str) -> str | None:
    """The value of ``name`` in a NUL-separated environment block (/proc/PID/environ)."""
    key = name.encode() + b"="
    for entry in data.split(b"\0"):
        if entry.startswith(key):
            return entry[len(key) :].decode(errors="replace")
    return None


def maps_cuda_driver(maps: str) -> bool:
    """True if a /proc/PID/maps text maps libcuda.so (the CUDA driver every MPS client loads)."""
    return any(re.search(r"/libcuda\.so(\.[0-9.]*)?$", line) for line in maps.splitlines())


def parse_stat_ppid(stat: str) -> int | None:
    """The parent PID field of a /proc/PID/stat line (the comm may hold spaces and parentheses)."""
    fields = stat[stat.rfind(")") + 1 :].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


_UUID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_KUBEPODS = re.compile(r"(?:kubelet-)?kubepods(?:\.slice)?")  # the kubelet's root (kind: kubelet-kubepods.slice)
_QOS = re.compile(r"(?:(?:kubelet-)?kubepods-)?(?:besteffort|burstable)(?:\.slice)?")
_POD = re.compile(rf"(?:(?:kubelet-)?kubepods-(?:besteffort-|burstable-)?)?pod({_UUID})(?:\.slice)?")
_CONTAINER = re.compile(r"(?:[a-z][a-z-]*-)?([0-9a-f]{64})(?:\.scope)?")  # cri-containerd-, crio-, docker-, libpod-
_KUBELET_ROOTS = ("kubelet.slice", "kubelet")  # a kubelet's --cgroup-root (kind)
_RUNTIME_ROOTS = ("machine.slice", "libpod_parent", "system.slice", "docker")  # root's container runtimes


def cgroup_path_owner(path: str) -> str:
    """``pod <uid> container <id12>`` (or ``container <id12>``) for a cgroup path, read at fixed
    depths: a pod is the component right under the kubelet's root (or its QoS class), its
    container the component right under the pod; a container of root's runtimes the component
    right under theirs. Whatever lies deeper (child cgroups a delegated container creates, named
    as it likes) is not read, and a path under any other root (a user's delegated tree on a
    bare host, a rootless runtime) names no one: "" then. A path that climbs out of mpsd's
    cgroup namespace (``/../..``, mpsd in a pod of its own) may start at the QoS class or pod."""
    parts = [part for part in path.split("/") if part]
    relative = parts[:1] == [".."]
    while parts[:1] == [".."]:
        parts.pop(0)
    if not relative and len(parts) > 1 and parts[0] in _RUNTIME_ROOTS:
        container = _CONTAINER.fullmatch(parts[1])
        return f"container {container.group(1)[:12]}" if container else ""
    if parts[:1] and parts[0] in _KUBELET_ROOTS:
        parts.pop(0)
    at = 1 if parts[:1] and _KUBEPODS.fullmatch(parts[0]) else 0
    if at == 0 and not relative:
        return ""  # not under the kubelet's root: no pod
    at += 1 if len(parts) > at and _QOS.fullmatch(parts[at]) else 0
    pod = _POD.fullmatch(parts[at]) if len(parts) > at else None
    if pod is None:
        return ""
    container = _CONTAINER.fullmatch(parts[at + 1]) if len(parts) > at + 1 else None
    return f"pod {pod.group(1).replace('_', '-')}" + (f" container {container.group(1)[:12]}" if container else "")


def cgroup_owner(text: str) -> str:
    """The owner (cgroup_path_owner) of the first line of a /proc/PID/cgroup text that names
    one; "" on a host."""
    for line in text.splitlines():
        owner = cgroup_path_owner(line.split(":", 2)[-1])
        if owner:
            return owner
    return ""


# ---------------------------------------------------------------- the kernel's view


def _read(path: str, limit: int = READ_LIMIT) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        chunks, left = [], limit
        while left > 0 and (chunk := os.read(fd, min(left, 65536))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def describe(pid: int, proc: str = "/proc") -> str:
    """``pid N (comm) pod … container …`` as far as /proc tells; never raises."""
    try:
        comm = _read(f"{proc}/{pid}/comm", 64).decode(errors="replace").strip()
    except OSError:
        return f"pid {pid}"
    try:
        owner = cgroup_owner(_read(f"{proc}/{pid}/cgroup").decode(errors="replace"))
    except OSError:
        owner = ""
    return " ".join(filter(None, [f"pid {pid} ({comm!r})", owner]))


def parent_pid(pid: int, proc: str = "/proc") -> int | None:
    """The parent of ``pid`` (None when it cannot be read: gone, or not in mpsd's PID namespace)."""
    try:
        stat = _read(f"{proc}/{pid}/stat", 4096).decode(errors="replace")
    except OSError:
        return None
    return parse_stat_ppid(stat)


def describe_all(pids: list[int], proc: str = "/proc", unreadable: str = "") -> str:
    """Each session holder described (one that has exited passed its socket on: a fork), or
    why none can be named (``unreadable``: Sessions.unreadable)."""
    gone = " (exited: a process it passed the socket to holds the session)"
    named = ", ".join(describe(pid, proc) + ("" if alive(pid, proc) else gone) for pid in pids)
    if named or not unreadable:
        return named or "a front-end mpsd cannot name"
    return f"a front-end mpsd cannot name ({unreadable}: mpsd needs CAP_SYS_PTRACE, docs/security.md)"


def held_reason(age: float, bound: float, who: str) -> str:
    """/readyz's reason while a held control session keeps health checks inconclusive."""
    return f"no health verdict for {age:.0f}s (verdictTimeout {bound:g}s): control session held by {who}"


def listener_pid(path: str, timeout: float = PROBE_TIMEOUT) -> int | None:
    """The PID that listens on the unix socket ``path`` (0 when it is outside mpsd's PID
    namespace); None when nothing listens or it does not take a connection in time."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError:  # gone, refused, not a socket, backlog full: the front-end fails alike
            return None
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return pid


def impostor(pipe_dir: str, daemon_pid: int, names: tuple[str, ...] = CONTROL_SOCKETS, proc: str = "/proc") -> str:
    """"" while every socket in ``names`` is served by ``daemon_pid`` (or by no one); else
    which socket is served by whom."""
    for name in names:
        path = os.path.join(pipe_dir, name)
        pid = listener_pid(path)
        if pid is not None and pid != daemon_pid:
            return f"{path} is served by {describe(pid, proc)}, not by the daemon pid {daemon_pid}"
    return ""


@dataclass(frozen=True)
class Sessions:
    """The sessions held on a daemon's control sockets, as its own descriptors show them."""

    peers: tuple[tuple[int, int], ...] = ()  # (PID, UID) that connected, for each session still connected
    unreadable: str = ""  # why the daemon's descriptors could not be read; "" when they were

    @property
    def holders(self) -> list[int]:
        """The PIDs that connected each held session, but mpsd's own (its impostor probes)."""
        return sorted({pid for pid, _uid in self.peers} - {os.getpid()})


def sessions(daemon_pid: int, pipe_dir: str, proc: str = "/proc") -> Sessions:
    """The sessions held on the daemon's control sockets: each socket it accepted on one of them
    (a copy taken with pidfd_getfd) whose peer is still connected, named by SO_PEERCRED.
    A session is held while its socket is open anywhere: a front-end that forked and exited
    leaves it held by its child, and the PID SO_PEERCRED names is then gone. A front-end
    that closed it (or died) holds nothing, even while a stopped daemon keeps its end.
    (/proc/PID/net/unix would not do: an accepted socket belongs to the network namespace
    of the one who connected.)"""
    paths = {os.path.join(pipe_dir, name) for name in CONTROL_SOCKETS}
    try:
        return Sessions(tuple(sorted(_peers(daemon_pid, paths, proc))))
    except PermissionError as exc:
        return Sessions(unreadable=f"cannot read the daemon's descriptors: {exc.strerror}")
    except OSError as exc:
        return Sessions(unreadable=f"cannot read the daemon's descriptors: {exc.strerror or exc}")


def session_holders(daemon_pid: int, pipe_dir: str, proc: str = "/proc") -> list[int]:
    """The PIDs that connected each session held on the daemon's control sockets (sessions);
    [] when none, or when they cannot be read. mpsd itself is never a holder: its impostor
    probes connect too, and the daemon may not have closed one yet."""
    return sessions(daemon_pid, pipe_dir, proc).holders


def session_peers(daemon_pid: int, pipe_dir: str, proc: str = "/proc") -> list[tuple[int, int]]:
    """(PID, UID) of every live process that holds a session on the daemon's control sockets:
    front-end sessions, servers, and CUDA clients (a client waiting for its server stays
    connected, mpsd/daemon/multiuser.py). [] when they cannot be read."""
    return [peer for peer in sessions(daemon_pid, pipe_dir, proc).peers if alive(peer[0], proc)]


def socket_peers(holder: int, paths: set[str] | None = None, proc: str = "/proc") -> set[int]:
    """PIDs at the other end of the connected unix sockets ``holder`` has accepted or connected
    (each one copied with pidfd_getfd and read with SO_PEERCRED); with ``paths``, only the
    sockets it accepted on one of them. Empty when they cannot be read."""
    try:
        return {pid for pid, _uid in _peers(holder, paths, proc)}
    except OSError:
        return set()


def _peers(holder: int, paths: set[str] | None, proc: str) -> set[tuple[int, int]]:
    """OSError when ``holder``'s descriptors cannot be read (gone: an empty set)."""
    try:
        fds = _socket_fds(f"{proc}/{holder}/fd")
        pidfd = os.pidfd_open(holder)
    except (FileNotFoundError, ProcessLookupError):
        return set()
    try:
        return {peer for fd in fds if (peer := _session_peer(pidfd, fd, paths)) is not None}
    finally:
        os.close(pidfd)


def alive(pid: int, proc: str = "/proc") -> bool:
    """True while ``pid`` runs (a zombie has closed its descriptors: not alive); a PID outside
    mpsd's PID namespace (0) is taken as alive."""
    if pid == 0:
        return True
    try:
        stat = _read(f"{proc}/{pid}/stat", 4096).decode(errors="replace")
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _socket_fds(fd_dir: str) -> list[int]:
    """The socket descriptors in ``fd_dir``; PermissionError when they cannot be read."""
    fds = []
    for name in os.listdir(fd_dir):
        try:
            if os.readlink(os.path.join(fd_dir, name)).startswith("socket:"):
                fds.append(int(name))
        except PermissionError:
            raise
        except (OSError, ValueError):
            continue  # closed meanwhile
    return fds


def _session_peer(pidfd: int, fd: int, paths: set[str] | None) -> tuple[int, int] | None:
    """(PID, UID) that connected the holder's ``fd`` if it is a unix socket still connected
    (with ``paths``: accepted on one of them); None for anything else (a listener, another
    kind of socket, one closed meanwhile, one whose peer has gone). OSError when the holder's
    descriptors cannot be copied (EPERM: not mpsd's to trace; ENOSYS: Linux < 5.6)."""
    libc = ctypes.CDLL(None, use_errno=True)
    dup = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
    if dup < 0:
        err = ctypes.get_errno()
        if err == errno.EBADF:
            return None  # closed meanwhile
        raise OSError(err, os.strerror(err))
    sock = socket.socket(fileno=dup)  # owns the copy
    try:
        if sock.family != socket.AF_UNIX or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return None
        if paths is not None and sock.getsockname() not in paths:  # an accepted socket has its listener's address
            return None
        if not _connected(sock):
            return None
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError:
        return None
    finally:
        sock.close()
    return pid, uid


def _connected(sock: socket.socket) -> bool:
    """False once the peer has closed its end (POLLHUP) or its writing side (POLLRDHUP)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP)  # POLLHUP and POLLERR are always reported
    gone = select.POLLHUP | select.POLLRDHUP | select.POLLERR
    return not any(events & gone for _fd, events in poller.poll(0))


def maps_cuda(pid: int, proc: str = "/proc") -> bool:
    """True if ``pid`` maps a CUDA driver (every CUDA client does; a front-end does not);
    False when its maps cannot be read."""
    try:
        return maps_cuda_driver(_read(f"{proc}/{pid}/maps", MAPS_LIMIT).decode(errors="replace"))
    except OSError:
        return False


def mps_client_problem(pid: int, daemon_pid: int, servers: list[int], proc: str = "/proc") -> str:
    """"" if ``pid`` can be shown to be an MPS client of the daemon ``daemon_pid``: the kernel
    names it (SO_PEERCRED, which the process cannot rewrite) as the peer of a unix socket the
    daemon or one of ``servers`` (its MPS servers, as the daemon lists them) holds, and it maps
    a CUDA driver. Else why not. Its environment is not asked: /proc/PID/environ is the
    process's own memory, which it can rewrite."""
    try:
        maps = _read(f"{proc}/{pid}/maps", MAPS_LIMIT).decode(errors="replace")
    except OSError as exc:
        return f"cannot read its /proc entries ({os.strerror(exc.errno or errno.EIO)})"
    holders = [daemon_pid, *servers]
    if not any(pid in socket_peers(holder, proc=proc) for holder in holders):
        names = ", ".join(map(str, servers)) or "none"
        return f"no socket of the MPS control daemon (pid {daemon_pid}) or its server(s) ({names}) connects to it"
    if not maps_cuda_driver(maps):
        return "it maps no CUDA driver (libcuda.so)"
    return ""
