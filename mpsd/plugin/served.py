"""One gRPC server on one unix socket that the kubelet dials, served again when the socket is
deleted or replaced (the kubelet's directories may be wiped while mpsd runs). The device
plugin's socket and the DRA driver's two sockets are each one of these."""

from __future__ import annotations

import logging
import os
from concurrent import futures
from typing import Callable

import grpc

from ..errors import MpsdError, PluginError
from .kubelet import socket_identity

log = logging.getLogger(__name__)


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
