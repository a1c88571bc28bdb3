"""The HTTP endpoints /metrics, /healthz and /readyz: a stdlib HTTP server in a daemon thread
(:func:`serve`) over a registry of families (mpsd/registry.py puts every face's together).
Every labelled group is replaced as a whole, so a label set that disappears (a pid that
exited, a pod that left) disappears from the scrape too (mpsd/metrics/base.py)."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Protocol
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST

from ..config import parse_address
from ..errors import SetupError

log = logging.getLogger(__name__)


# -- HTTP --------------------------------------------------------------------------------


class Scraped(Protocol):
    """What /metrics serves: mpsd.registry.Metrics, or any families with a scrape."""

    def scrape(self) -> bytes: ...


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    timeout = 10  # seconds a slow client may hold a handler thread

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(200, self.server.metrics.scrape(), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            ok, reason = _probe(self.server.live)
            self._reply(200 if ok else 503, b"ok\n" if ok else f"{reason or 'not live'}\n".encode())
        elif path == "/readyz":
            ok, reason = _probe(self.server.ready)
            self._reply(200 if ok else 503, b"ok\n" if ok else f"{reason or 'not ready'}\n".encode())
        else:
            self._reply(404, b"not found: try /metrics, /healthz or /readyz\n")

    def _reply(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib signature)
        log.debug("http client=%s " + format, self.address_string(), *args)


Probe = Callable[[], "tuple[bool, str] | bool"]


def _probe(check: Probe) -> tuple[bool, str]:
    """Run a probe callable returning ok or (ok, reason); one that raises counts as failing,
    with the error as reason."""
    try:
        result = check()
    except Exception as e:  # noqa: BLE001 - a broken probe must answer 503, not drop the connection
        log.warning("probe raised error=%r", e)
        return False, f"probe failed: {e}"
    if isinstance(result, tuple):
        ok, reason = result
        return bool(ok), str(reason)
    return bool(result), ""


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, metrics: Scraped, live: Probe, ready: Probe) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.metrics, self.live, self.ready = metrics, live, ready
        super().__init__((host, port), _Handler)


class Server:
    """A running metrics/probe endpoint; ``close()`` stops it and frees the port."""

    def __init__(self, httpd: _HTTPServer) -> None:
        self._httpd = httpd
        self.host: str = str(httpd.server_address[0])  # an IPv4 or IPv6 address
        self.port: int = httpd.server_address[1]
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="mpsd-metrics", daemon=True
        )
        self._thread.start()
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
        log.info("metrics endpoint closed host=%s port=%s", self.host, self.port)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(address: str, metrics: Scraped, live: Probe, ready: Probe) -> Server:
    """Serve /metrics, /healthz and /readyz on ``address`` ("host:port") in a daemon thread.
    ``live``/``ready`` return ok or (ok, reason); 503 carries the reason."""
    host, port = parse_address(address)
    try:
        httpd = _HTTPServer(host, port, metrics, live, ready)
    except OSError as e:
        raise SetupError(f"metricsAddress: cannot listen on {address!r}: {e.strerror or e}") from e
    server = Server(httpd)
    log.info("metrics endpoint listening host=%s port=%s", server.host, server.port)
    return server
