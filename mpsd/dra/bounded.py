"""Every call to the API server bounded in total time and in answer size, at the socket.

httpx's timeouts bound each read, write and connect on its own: a server that sends one byte
every few seconds, inside the headers or the body, keeps a call going forever, and an answer is
read whole whatever its size. Here each call runs under a :class:`Budget` (a deadline and a
number of bytes) that the network layer under httpx enforces on every operation: a connect, a
TLS handshake, a write or a read gets at most the time left to the call, and the bytes an answer
brings count against its cap, headers included. So a call ends within its timeout (plus the time
of one system call) and holds at most the cap in memory, whatever the server does.

Answers are asked for unencoded (``Accept-Encoding: identity``; the API server compresses only
when asked) and one that comes encoded anyway is refused: a small gzip answer could unpack to
gigabytes after the cap was counted. Name resolution is the system resolver's, not bounded here
(an in-cluster address is an IP). Proxies from the environment are not used (httpx ignores
them with a transport of its own); the API server is reached directly.
"""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpcore2
import httpx2


class AnswerRefused(Exception):
    """The API server's answer is larger than the cap, or encoded."""


@dataclass
class Budget:
    deadline: float  # time.monotonic()
    left: int  # bytes the answers may still bring
    cap: int

    def time_left(self, timeout: float | None, exc: type[Exception]) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise exc("the call's time is up")
        return left if timeout is None else min(timeout, left)

    def take(self, nbytes: int) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise AnswerRefused(f"answer larger than {_size(self.cap)}")


_budget: ContextVar[Budget | None] = ContextVar("mpsd_kubeapi_budget", default=None)


@contextlib.contextmanager
def bounded(timeout: float, cap: int) -> Iterator[Budget]:
    """Run the calls inside under one budget: ``timeout`` seconds, ``cap`` bytes."""
    budget = Budget(time.monotonic() + timeout, cap, cap)
    token = _budget.set(budget)
    try:
        yield budget
    finally:
        _budget.reset(token)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0 else f"{nbytes} bytes"


class _Stream(httpcore2.NetworkStream):
    def __init__(self, inner: httpcore2.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        budget = _budget.get()
        if budget is None:
            return self._inner.read(max_bytes, timeout)
        data = self._inner.read(max_bytes, budget.time_left(timeout, httpcore2.ReadTimeout))
        budget.take(len(data))
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        budget = _budget.get()
        if budget is not None:
            timeout = budget.time_left(timeout, httpcore2.WriteTimeout)
        self._inner.write(buffer, timeout)

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore2.NetworkStream:
        budget = _budget.get()
        if budget is not None:
            timeout = budget.time_left(timeout, httpcore2.ConnectTimeout)
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore2.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore2.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore2.NetworkStream:
        budget = _budget.get()
        if budget is not None:
            timeout = budget.time_left(timeout, httpcore2.ConnectTimeout)
        return _Stream(self._inner.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore2.NetworkStream:
        budget = _budget.get()
        if budget is not None:
            timeout = budget.time_left(timeout, httpcore2.ConnectTimeout)
        return _Stream(self._inner.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class BoundedTransport(httpx2.HTTPTransport):
    """httpx's own transport over a connection pool whose sockets obey the current Budget."""

    def __init__(self, ssl_context: ssl.SSLContext) -> None:
        super().__init__(verify=ssl_context)
        limits = httpx2.Limits(max_connections=32, max_keepalive_connections=8, keepalive_expiry=30.0)
        # HTTPTransport keeps its httpcore pool in _pool: the same pool, with this network backend
        self._pool = httpcore2.ConnectionPool(
            ssl_context=ssl_context, max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
            network_backend=_Backend(),
        )

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        request.headers["Accept-Encoding"] = "identity"
        response = super().handle_request(request)
        budget = _budget.get()
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        length = response.headers.get("Content-Length", "")
        refused = None
        if encoding not in ("", "identity"):
            refused = f"answer encoded {encoding[:20]!r}, asked for identity"
        elif budget is not None and length.isascii() and length.isdigit() and (
                len(length) > 19 or int(length) > budget.cap):
            refused = f"answer of {length} bytes, larger than {_size(budget.cap)}"
        if refused is not None:
            response.close()
            raise AnswerRefused(refused)
        return response
