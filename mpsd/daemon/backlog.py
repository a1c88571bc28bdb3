"""Who fills a unix socket's accept queue, as the kernel tells it (sock_diag, ``ss -xp``'s source).

A listening socket takes at most its backlog of connections that its process has not yet
accepted; past that, ``connect()`` waits and fails like a socket nobody serves. Anyone who can
reach ``control_privileged`` (root in any pod handed the pipe dir, through its read-only mount)
can fill the daemon's queue and hold it full, and the proof of mpsd.daemon.genuine then finds
"nobody answers". So before saying that, mpsd asks the kernel: ``NETLINK_SOCK_DIAG`` dumps the
listening unix sockets with their queue (``UNIX_DIAG_RQLEN``: queued, backlog), the inode of
the file they are bound to (``UNIX_DIAG_VFS``) and the inodes of the connecting sockets in the
queue (``UNIX_DIAG_ICONS``); ``/proc/*/fd`` names the processes holding those sockets, whatever
their network namespace. Nothing here is what a process says about itself.

The listener lives in the daemon's network namespace (a holder's pod may have its own): the
netlink socket is opened there, from a short-lived thread that enters it (``setns``, which
needs CAP_SYS_ADMIN), when it is not mpsd's own.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import threading
from dataclasses import dataclass

from . import peer

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
UDIAG_SHOW_VFS, UDIAG_SHOW_ICONS, UDIAG_SHOW_RQLEN = 0x2, 0x8, 0x10
UNIX_DIAG_VFS, UNIX_DIAG_ICONS, UNIX_DIAG_RQLEN = 1, 3, 4
TCP_LISTEN = 10
CLONE_NEWNET = 0x40000000
DUMP_LIMIT = 64 << 20  # bytes of answers read at most (a node's listening unix sockets)
NAMED = 5  # holders named in one line at most; the rest are counted


@dataclass(frozen=True)
class Queue:
    """A listening socket's accept queue: connections waiting, its backlog, and the inodes of
    the connecting sockets that wait."""

    queued: int
    backlog: int
    waiting: tuple[int, ...]

    @property
    def full(self) -> bool:
        return self.queued > self.backlog  # the kernel refuses a connection past that (unix_recvq_full)


# ---------------------------------------------------------------- pure


def request(seq: int = 1) -> bytes:
    """A sock_diag dump request for every listening unix socket, with its file's inode, its
    queue and the sockets waiting in it."""
    body = struct.pack("=BBHIII8x", socket.AF_UNIX, 0, 0, 1 << TCP_LISTEN, 0,
                       UDIAG_SHOW_VFS | UDIAG_SHOW_ICONS | UDIAG_SHOW_RQLEN)  # fmt: skip
    return struct.pack("=IHHII", 16 + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def parse(data: bytes) -> tuple[dict[int, Queue], bool]:
    """{file inode: Queue} of the listening sockets in a dump's answers, and whether the dump
    is done (NLMSG_DONE). OSError for an NLMSG_ERROR answer."""
    found: dict[int, Queue] = {}
    offset = 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16 or offset + length > len(data):
            break
        if kind == NLMSG_DONE:
            return found, True
        if kind == NLMSG_ERROR:
            code = -struct.unpack_from("=i", data, offset + 16)[0]
            raise OSError(code, os.strerror(code))
        if kind == SOCK_DIAG_BY_FAMILY:
            _message(data[offset + 16 : offset + length], found)
        offset += (length + 3) & ~3
    return found, False


def _message(msg: bytes, found: dict[int, Queue]) -> None:
    """One unix_diag_msg and its attributes, into ``found`` when it names a bound file."""
    inode, queued, backlog, waiting = None, 0, 0, ()
    offset = 16  # family, type, state, pad, ino, cookie[2]
    while offset + 4 <= len(msg):
        length, kind = struct.unpack_from("=HH", msg, offset)
        if length < 4:
            break
        value = msg[offset + 4 : offset + length]
        if kind == UNIX_DIAG_VFS and len(value) >= 8:
            inode = struct.unpack_from("=I", value)[0]
        elif kind == UNIX_DIAG_RQLEN and len(value) >= 8:
            queued, backlog = struct.unpack_from("=II", value)
        elif kind == UNIX_DIAG_ICONS:
            waiting = struct.unpack(f"={len(value) // 4}I", value[: len(value) // 4 * 4])
        offset += (length + 3) & ~3
    if inode is not None:
        found[inode] = Queue(queued, backlog, tuple(waiting))


# ---------------------------------------------------------------- the kernel's view


def listener_queue(path: str, netns_of: int | None = None, proc: str = "/proc") -> Queue | None:
    """The accept queue of the socket listening on ``path`` (by the inode of the file), asked in
    the network namespace of process ``netns_of`` (mpsd's own when None); None when no
    listening socket is bound to it there. OSError when the kernel cannot be asked."""
    inode = os.stat(path).st_ino
    with _diag_socket(netns_of, proc) as sock:
        sock.settimeout(peer.PROBE_TIMEOUT)
        sock.send(request())
        total = 0
        while total < DUMP_LIMIT:
            chunk = sock.recv(1 << 16)  # whole netlink messages, one batch of the dump
            total += len(chunk)
            found, done = parse(chunk)
            if inode in found:
                return found[inode]
            if done or not chunk:
                return None
    return None


def _diag_socket(netns_of: int | None, proc: str) -> socket.socket:
    def open_diag() -> socket.socket:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)

    if netns_of is None or os.readlink(f"{proc}/{netns_of}/ns/net") == os.readlink(f"{proc}/self/ns/net"):
        return open_diag()
    result: list[socket.socket | OSError] = []

    def enter() -> None:  # this thread alone enters the namespace, and ends there
        try:
            fd = os.open(f"{proc}/{netns_of}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    code = ctypes.get_errno()
                    raise OSError(code, f"setns: {os.strerror(code)}")
            finally:
                os.close(fd)
            result.append(open_diag())
        except OSError as exc:
            result.append(exc)

    thread = threading.Thread(target=enter, name="sockdiag-netns", daemon=True)
    thread.start()
    thread.join()
    if not result:
        raise OSError(errno.EIO, "could not enter the daemon's network namespace")
    if isinstance(result[0], OSError):
        raise result[0]
    return result[0]


def socket_owners(inodes: set[int], proc: str = "/proc") -> list[int]:
    """PIDs holding a descriptor of one of the sockets ``inodes`` (from ``/proc/*/fd``)."""
    links = {f"socket:[{inode}]" for inode in inodes}
    owners = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"{proc}/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{proc}/{name}/fd/{fd}") in links:
                    owners.append(int(name))
                    break
            except OSError:
                continue
    return sorted(owners)


def why_no_answer(path: str, daemon: int, proc: str = "/proc") -> str:
    """Why ``path`` (the daemon's listening socket) took no connection, in words: its queue
    is full, held by whom; or nobody answers it."""
    try:
        queue = listener_queue(path, daemon, proc)
    except OSError as exc:
        return f"nobody answers {path} (its queue could not be read: {exc.strerror or exc})"
    if queue is None or not queue.full:
        return f"nobody answers {path}"
    owners = socket_owners(set(queue.waiting), proc)
    named = ", ".join(peer.describe(pid, proc) for pid in owners[:NAMED]) or "processes mpsd cannot see"
    more = f" and {len(owners) - NAMED} more" if len(owners) > NAMED else ""
    return (f"{path} takes no connection: its queue is full ({queue.queued} waiting, backlog {queue.backlog}), "
            f"held by {named}{more}")  # fmt: skip
