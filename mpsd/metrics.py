"""Prometheus metrics and the HTTP endpoints /metrics, /healthz and /readyz.

:class:`Metrics` owns the prometheus objects (in its own registry unless given one, so
tests stay isolated) and is updated from plain values; every labelled group is replaced
as a whole, so a label set that disappears (a pid that exited, a pod that left) disappears
from the scrape too (mpsd/metricbase.py). The families are split by face, as the rest of the
tree: the supervisor's, the GPUs' and mpsd exec's in mpsd/supervisor_metrics.py, the device
plugin's in mpsd/plugin/metrics.py, the DRA driver's in mpsd/dra/metrics.py; Metrics has them
all. :func:`serve` runs a stdlib HTTP server in a daemon thread.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from mpsd.errors import ConfigError, SetupError

from .dra.metrics import CLAIM_LABELS, ClaimMetrics, ClaimUsage
from .plugin.metrics import ALLOCATION_LABELS, AllocationMetrics, AllocationUsage
from .supervisor_metrics import (
    HEALTH_CHECK_BUCKETS,
    MAX_ERROR_LABEL,
    REFUSAL_REASONS,
    REGION_KINDS,
    SupervisorMetrics,
)

__all__ = [
    "ALLOCATION_LABELS", "CLAIM_LABELS", "HEALTH_CHECK_BUCKETS", "MAX_ERROR_LABEL", "REFUSAL_REASONS", "REGION_KINDS",
    "AllocationUsage", "ClaimUsage", "Metrics", "Server", "parse_address", "serve",
]

log = logging.getLogger(__name__)


class Metrics(SupervisorMetrics, AllocationMetrics, ClaimMetrics):
    """Every face's families in one registry (scraped in this order)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self._init_supervisor(self.registry)
        self._init_allocations(self.registry)
        self._init_claims(self.registry)


# -- HTTP --------------------------------------------------------------------------------


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` → (host, port). IPv6 hosts in brackets (``[::1]:9400``); an empty host
    (``:9400``) means every IPv4 interface; port 0 picks a free port."""
    accepted = 'expected host:port with port 0..65535, e.g. "0.0.0.0:9400" or "[::1]:9400"'
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"metricsAddress: {accepted}, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            host = str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError as e:
            raise ConfigError(f"metricsAddress: {accepted}, got {address!r} (bad IPv6 address)") from e
    elif not host:
        host = "0.0.0.0"
    elif not _is_hostname(host):
        raise ConfigError(f"metricsAddress: {accepted}, got {address!r} (bad host {host!r})")
    return host, int(port_text)


def _is_hostname(host: str) -> bool:
    """A dotted IPv4 address or a DNS name (letters, digits, '-', '.'); no bare IPv6."""
    if len(host) > 253 or not host.isascii():
        return False
    labels = host.split(".")
    return all(label and len(label) <= 63 and label.replace("-", "").isalnum() for label in labels)


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

    def __init__(self, host: str, port: int, metrics: Metrics, live: Probe, ready: Probe) -> None:
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


def serve(address: str, metrics: Metrics, live: Probe, ready: Probe) -> Server:
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
