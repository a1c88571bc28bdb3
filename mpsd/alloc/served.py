"""One gRPC server on one unix socket that the kubelet dials, served again when the socket is
deleted or replaced (the kubelet's directories may be wiped while mpsd runs). The device
plugin's socket and the DRA driver's two sockets are each one of these.

Rolling updates: the old and the new mpsd pod of a DaemonSet with ``maxSurge`` serve side by
side, each on sockets of its own name (``instance_id``: the pod's UID, from ``POD_UID``), so
that neither removes or replaces the other's. A socket of an earlier instance that nobody
serves any more (its pod was killed) is removed at start (``remove_stale_sockets``), as the
kubelet's plugin watcher README asks of a new instance; a live one is left alone.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import stat
from concurrent import futures
from typing import Callable, Iterable, Mapping

import grpc

from .. import grpcready  # noqa: F401  (first: one line, not a traceback, if grpcio is too old)
from ..errors import MpsdError, PluginError

log = logging.getLogger(__name__)

INSTANCE_ENV = "POD_UID"  # the DaemonSet sets it from the downward API (metadata.uid)
UNIX_PATH_MAX = 107  # bytes of a socket path: sun_path is 108 with its terminating NUL
_INSTANCE = re.compile(r"[A-Za-z0-9][-A-Za-z0-9]{0,62}")


def socket_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of ``path``, or None when it does not exist: a re-created socket differs."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot stat socket path=%s error=%s", path, exc)
        return None
    return (st.st_dev, st.st_ino)



def instance_id(environ: Mapping[str, str] = os.environ) -> str:
    """This mpsd instance's name for its sockets: ``POD_UID``, "" when it is not set (one
    instance at a time: the fixed socket names). Error for a value that cannot be a file name part."""
    value = environ.get(INSTANCE_ENV, "")
    if value and _INSTANCE.fullmatch(value) is None:
        raise PluginError(f"bad {INSTANCE_ENV} {value[:80]!r}: expected a pod UID (letters, digits and '-', "
                          "at most 63), as the downward API's metadata.uid gives it")
    return value


def remove_stale_sockets(paths: Iterable[str], keep: Iterable[str] = (), timeout: float = 1.0) -> list[str]:
    """Unlink each of ``paths`` that is a unix socket nobody accepts on (connection refused):
    left by an instance that was killed. Sockets that answer, other files, symlinks and
    ``keep`` stay. Returns the paths removed."""
    removed = []
    kept = {os.path.abspath(k) for k in keep}
    for path in paths:
        if os.path.abspath(path) in kept:
            continue
        try:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                continue
        except OSError:
            continue
        if _answers(path, timeout):
            log.info("another instance serves socket=%s (left alone)", path)
            continue
        try:
            os.unlink(path)
        except OSError as exc:
            log.warning("stale socket not removed path=%s error=%s", path, exc.strerror or exc)
            continue
        log.info("stale socket of an earlier instance removed path=%s", path)
        removed.append(path)
    return removed


def _answers(path: str, timeout: float) -> bool:
    """Whether something accepts connections on the unix socket ``path``; only a refusal (or
    a missing socket) says no: anything else (a full backlog, a permission) counts as alive."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as exc:
            return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    return True


class ServedSocket:
    def __init__(
        self,
        path: str,
        add: Callable[[grpc.Server], None],
        workers: int,
        *,
        what: str,
        thread_prefix: str,
        error: type[MpsdError] = PluginError,
        dir_mode: int = 0o777,
    ) -> None:
        """``add`` puts the servicers on a new server; ``what`` names the socket in messages
        ("plugin socket"); failures raise ``error``."""
        self.path, self.add, self.workers = path, add, workers
        self.what, self.thread_prefix, self.error, self.dir_mode = what, thread_prefix, error, dir_mode
        self.server: grpc.Server | None = None
        self.identity: tuple[int, int] | None = None

    def serve(self) -> None:
        self.stop()
        try:
            os.makedirs(os.path.dirname(self.path), mode=self.dir_mode, exist_ok=True)
            if os.path.lexists(self.path):
                os.unlink(self.path)
        except OSError as exc:
            raise self.error(f"cannot prepare {self.what} {self.path}: {exc.strerror or exc}") from exc
        pool = futures.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=self.thread_prefix)
        server = grpc.server(pool)
        self.add(server)
        if server.add_insecure_port("unix://" + os.path.abspath(self.path)) == 0:
            raise self.error(f"cannot listen on {self.what} {self.path}")
        server.start()
        self.server, self.identity = server, socket_identity(self.path)
        log.info("serving %s path=%s", self.what, self.path)

    def check(self) -> bool:
        """Serve again if the socket was deleted or replaced; True when it was."""
        if socket_identity(self.path) == self.identity:
            return False
        log.warning("%s missing or replaced, serving again path=%s", self.what, self.path)
        self.serve()
        return True

    def stop(self) -> None:
        if self.server is None:
            return
        self.server.stop(grace=1.0).wait()
        self.server = None
        try:
            if socket_identity(self.path) == self.identity:
                os.unlink(self.path)
        except OSError:
            pass
        self.identity = None
