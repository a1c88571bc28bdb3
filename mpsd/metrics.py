"""Prometheus metrics and the HTTP endpoints /metrics, /healthz and /readyz.

:class:`Metrics` owns the prometheus objects (in its own registry unless given one, so
tests stay isolated) and is updated from plain values; every labelled group is replaced
as a whole, so a label set that disappears (a pid that exited, a pod that left) disappears
from the scrape too. :func:`serve` runs a stdlib HTTP server in a daemon thread.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mpsd.errors import ConfigError, SetupError

if TYPE_CHECKING:
    from mpsd.exec_regions import RegionUsage
    from mpsd.inventory import Client, Gpu

log = logging.getLogger(__name__)

HEALTH_CHECK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MAX_ERROR_LABEL = 200  # characters of the last error kept as a label value
ALLOCATION_LABELS = ("allocation", "pod", "namespace", "container", "gpu")
CLAIM_LABELS = ("claim", "namespace", "pod", "gpu")
REGION_KINDS = ("allocation", "exec")  # a device-plugin allocation's region, an mpsd exec region
# why a region was refused (shim.RegionError.reason); "missing" (gone meanwhile) is no refusal
REFUSAL_REASONS = ("corrupted", "not_regular", "too_large", "unreadable")


@dataclass(frozen=True)
class AllocationUsage:
    """One device-plugin allocation: its memory limit and what its processes use now."""

    allocation_id: str
    pod: str
    namespace: str
    container: str
    gpu: int | str
    limit_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class ClaimUsage:
    """One prepared DRA claim on one GPU: what it consumed and what its processes use now."""

    claim: str
    namespace: str
    pod: str  # the pods of status.reservedFor, comma-separated
    gpu: int | str
    memory_bytes: int  # consumed: the cap of all its containers together
    compute_percent: float  # consumed: the active thread percentage
    used_bytes: int


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._lock = threading.Lock()
        self._label_sets: dict[int, set[tuple[str, ...]]] = {}  # id(gauge) → label sets set last
        self._restarts_seen = 0  # update_supervisor's view of the previous snapshot
        self._latency_seen: float | None = None
        self._error_seen = ""
        self.daemon_up = Gauge("mpsd_daemon_up", "1 while the MPS control daemon is running", registry=r)
        self.daemon_restarts = Counter(
            "mpsd_daemon_restarts", "Restarts of the MPS control daemon by the supervisor", registry=r
        )
        self.health_check_seconds = Histogram(
            "mpsd_health_check_seconds",
            "Duration of one health check of the control daemon",
            buckets=HEALTH_CHECK_BUCKETS,
            registry=r,
        )
        self.last_error_info = Gauge(
            "mpsd_last_error_info",
            "The last error the supervisor saw (value 1, text in the label)",
            ["message"],
            registry=r,
        )
        self.last_error_timestamp = Gauge(
            "mpsd_last_error_timestamp_seconds", "Unix time of the last error (0: none yet)", registry=r
        )
        self.mps_servers = Gauge("mpsd_mps_servers", "MPS servers running per GPU", ["gpu"], registry=r)
        self.mps_clients = Gauge("mpsd_mps_clients", "MPS client processes per GPU (NVML)", ["gpu"], registry=r)
        self.client_memory = Gauge(
            "mpsd_client_memory_bytes",
            "Device memory used by one MPS client process (NVML)",
            ["gpu", "pid"],
            registry=r,
        )
        self.gpu_memory_total = Gauge(
            "mpsd_gpu_memory_total_bytes", "Device memory of the GPU (NVML)", ["gpu", "uuid"], registry=r
        )
        self.gpu_memory_used = Gauge(
            "mpsd_gpu_memory_used_bytes", "Device memory in use on the GPU (NVML)", ["gpu", "uuid"], registry=r
        )
        self.config_generation = Gauge(
            "mpsd_config_generation",
            "Generation of the applied MPS configuration (bumped on every re-apply)",
            registry=r,
        )
        self.device_healthy = Gauge(
            "mpsd_device_healthy", "1 if the GPU is offered as healthy to the kubelet", ["gpu"], registry=r
        )
        self.fault_terminations = Counter(
            "mpsd_fault_terminations",
            "Clients of an MPS server in FAULT ended by faultPolicy terminate, by how",
            ["method"],
            registry=r,
        )
        for method in ("terminate_client", "sigkill"):  # exported from the start, at 0
            self.fault_terminations.labels(method)
        self._terminations_seen: dict[str, int] = {}
        self.control_impostors = Counter(
            "mpsd_control_impostors",
            "Control sockets found served by another process than mpsd's daemon (the daemon is restarted)",
            registry=r,
        )
        self.defaults_restored = Counter(
            "mpsd_defaults_restored",
            "Health checks that found the daemon's defaults changed (any UID can set them) and put them back",
            registry=r,
        )
        self.verdict_age = Gauge(
            "mpsd_health_verdict_age_seconds",
            "Seconds since the last conclusive health check (grows while a held control session blinds it)",
            registry=r,
        )
        self.defaults_contested = Gauge(
            "mpsd_defaults_contested_seconds",
            "Seconds the daemon's defaults have been found changed (and put back) at every health check in a row",
            registry=r,
        )
        self._control_seen = (0, 0)  # (impostors, defaults restored) of the previous snapshot
        self.allocation_used = Gauge(
            "mpsd_allocation_memory_used_bytes",
            "Device memory used by one device-plugin allocation (shim accounting)",
            list(ALLOCATION_LABELS),
            registry=r,
        )
        self.allocation_limit = Gauge(
            "mpsd_allocation_memory_limit_bytes",
            "Device memory limit of one device-plugin allocation",
            list(ALLOCATION_LABELS),
            registry=r,
        )

        self.claim_memory = Gauge(
            "mpsd_claim_memory_bytes",
            "Device memory a prepared DRA claim consumed: the cap its containers share",
            list(CLAIM_LABELS),
            registry=r,
        )
        self.claim_compute = Gauge(
            "mpsd_claim_compute_percent",
            "Active thread percentage (percent of SMs) a prepared DRA claim consumed",
            list(CLAIM_LABELS),
            registry=r,
        )
        self.claim_used = Gauge(
            "mpsd_claim_memory_used_bytes",
            "Device memory the processes of a prepared DRA claim hold now (shim accounting)",
            list(CLAIM_LABELS),
            registry=r,
        )
        self.mps_servers_faulted = Gauge(
            "mpsd_mps_servers_faulted", "MPS servers in FAULT at the last health check", registry=r
        )
        self.region_cap = Gauge(
            "mpsd_region_memory_cap_bytes",
            "Memory cap of one device of an mpsd exec region (shim accounting)",
            ["region", "device"],
            registry=r,
        )
        self.region_used = Gauge(
            "mpsd_region_memory_used_bytes",
            "Device memory held by the processes of an mpsd exec region (shim accounting)",
            ["region", "device"],
            registry=r,
        )
        self.region_process = Gauge(
            "mpsd_region_process_memory_bytes",
            "Device memory held by one live process of an mpsd exec region (shim accounting)",
            ["region", "device", "pid"],
            registry=r,
        )
        self.regions_refused = Counter(
            "mpsd_regions_refused",
            "Reads of a region mpsd refused (every round that refuses it counts), by region kind and why",
            ["kind", "reason"],
            registry=r,
        )
        for kind in REGION_KINDS:  # exported from the start, at 0: increase() sees the first refusal
            for reason in REFUSAL_REASONS:
                self.regions_refused.labels(kind, reason)

    # -- supervisor --------------------------------------------------------------------

    def set_daemon_up(self, up: bool) -> None:
        self.daemon_up.set(1 if up else 0)

    def daemon_restarted(self) -> None:
        self.daemon_restarts.inc()

    def observe_health_check(self, seconds: float) -> None:
        self.health_check_seconds.observe(seconds)

    def set_last_error(self, message: str, when: float | None = None) -> None:
        """Record the latest error; only the latest message is exported. "" clears it."""
        text = " ".join(message.split())[:MAX_ERROR_LABEL]
        with self._lock:
            self._replace(self.last_error_info, {(text,): 1.0} if text else {})
            if text:
                self.last_error_timestamp.set(time.time() if when is None else when)

    def set_config_generation(self, generation: int) -> None:
        self.config_generation.set(generation)

    def set_faulted_servers(self, count: int) -> None:
        self.mps_servers_faulted.set(count)

    def set_mps_servers(self, per_gpu: Mapping[int | str, int]) -> None:
        with self._lock:
            self._replace(self.mps_servers, {(str(gpu),): float(n) for gpu, n in per_gpu.items()})

    def set_device_health(self, per_gpu: Mapping[int, bool]) -> None:
        with self._lock:
            self._replace(self.device_healthy, {(str(gpu),): 1.0 if ok else 0.0 for gpu, ok in per_gpu.items()})

    def update_supervisor(
        self,
        *,
        daemon_up: bool,
        restarts: int,
        health_latency: float | None,
        last_error: str,
        servers: int | Mapping[int, int],
        config_generation: int,
    ) -> None:
        """One supervisor status snapshot (mpsd.node pushes one per change). ``restarts`` is
        the running total: the counter advances by the difference. Snapshots repeat the last
        latency and error, so a latency is observed and an error stamped only when it
        changes. ``servers`` as a plain count is exported with gpu="all"."""
        with self._lock:
            new_restarts = max(restarts - self._restarts_seen, 0)
            self._restarts_seen = restarts
            new_latency = health_latency is not None and health_latency != self._latency_seen
            self._latency_seen = health_latency
            new_error = last_error != self._error_seen
            self._error_seen = last_error
        self.set_daemon_up(daemon_up)
        if new_restarts:
            self.daemon_restarts.inc(new_restarts)
        if new_latency:
            self.observe_health_check(float(health_latency))  # type: ignore[arg-type]
        if new_error:
            self.set_last_error(last_error)
        self.set_mps_servers({"all": servers} if isinstance(servers, int) else servers)
        self.set_config_generation(config_generation)

    def set_control_plane(
        self, impostors: int, defaults_restored: int, verdict_age: float, defaults_contested: float = 0.0
    ) -> None:
        """Running totals from the supervisor: the counters advance by the difference."""
        with self._lock:
            seen_impostors, seen_restored = self._control_seen
            self._control_seen = (max(impostors, seen_impostors), max(defaults_restored, seen_restored))
        if impostors > seen_impostors:
            self.control_impostors.inc(impostors - seen_impostors)
        if defaults_restored > seen_restored:
            self.defaults_restored.inc(defaults_restored - seen_restored)
        self.verdict_age.set(verdict_age)
        self.defaults_contested.set(defaults_contested)

    def set_fault_terminations(self, totals: Mapping[str, int]) -> None:
        """Running totals per method (terminate_client, sigkill): each counter advances by the
        difference to the last totals seen."""
        with self._lock:
            for method, total in totals.items():
                new = total - self._terminations_seen.get(method, 0)
                if new > 0:
                    self.fault_terminations.labels(method).inc(new)
                self._terminations_seen[method] = max(total, self._terminations_seen.get(method, 0))

    # -- inventory ---------------------------------------------------------------------

    def observe_inventory(self, gpus: Iterable[Gpu], clients: Iterable[Client]) -> None:
        """GPU memory and MPS clients from one inventory pass; replaces the previous pass.
        A client whose memory NVML cannot tell is counted but has no memory series."""
        total: dict[tuple[str, ...], float] = {}
        used: dict[tuple[str, ...], float] = {}
        per_gpu: dict[tuple[str, ...], float] = {}
        memory: dict[tuple[str, ...], float] = {}
        for gpu in gpus:
            total[(str(gpu.index), gpu.uuid)] = float(gpu.memory_total)
            used[(str(gpu.index), gpu.uuid)] = float(gpu.memory_used)
            per_gpu[(str(gpu.index),)] = 0.0
        for client in clients:
            key = (str(client.gpu_index),)
            per_gpu[key] = per_gpu.get(key, 0.0) + 1
            if client.used_memory is not None:
                mkey = (str(client.gpu_index), str(client.pid))
                memory[mkey] = memory.get(mkey, 0.0) + float(client.used_memory)
        with self._lock:
            self._replace(self.gpu_memory_total, total)
            self._replace(self.gpu_memory_used, used)
            self._replace(self.mps_clients, per_gpu)
            self._replace(self.client_memory, memory)

    def update_gpus(self, gpus: Iterable[Gpu], clients: Iterable[Client]) -> None:
        """Alias of observe_inventory (the name mpsd.node calls)."""
        self.observe_inventory(gpus, clients)

    # -- device plugin -----------------------------------------------------------------

    def set_allocations(self, rows: Iterable[AllocationUsage]) -> None:
        limits: dict[tuple[str, ...], float] = {}
        used: dict[tuple[str, ...], float] = {}
        for row in rows:
            key = (row.allocation_id, row.pod, row.namespace, row.container, str(row.gpu))
            limits[key] = float(row.limit_bytes)
            used[key] = float(row.used_bytes)
        with self._lock:
            self._replace(self.allocation_limit, limits)
            self._replace(self.allocation_used, used)

    def set_claims(self, rows: Iterable[ClaimUsage]) -> None:
        """The prepared DRA claims as read now; replaces the last set (an unprepared claim's series go)."""
        memory: dict[tuple[str, ...], float] = {}
        compute: dict[tuple[str, ...], float] = {}
        used: dict[tuple[str, ...], float] = {}
        for row in rows:
            key = (row.claim, row.namespace, row.pod, str(row.gpu))
            memory[key], compute[key], used[key] = float(row.memory_bytes), row.compute_percent, float(row.used_bytes)
        with self._lock:
            self._replace(self.claim_memory, memory)
            self._replace(self.claim_compute, compute)
            self._replace(self.claim_used, used)

    # -- mpsd exec regions ---------------------------------------------------------------

    def set_regions(self, rows: Iterable[RegionUsage]) -> None:
        """The regions of mpsd exec (mpsd.exec_regions) as read now; replaces the last set."""
        cap: dict[tuple[str, ...], float] = {}
        used: dict[tuple[str, ...], float] = {}
        per_process: dict[tuple[str, ...], float] = {}
        for row in rows:
            key = (row.region, str(row.device))
            cap[key] = float(row.cap_bytes)
            used[key] = float(row.used_bytes)
            for pid, nbytes in row.processes:
                per_process[(*key, str(pid))] = float(nbytes)
        with self._lock:
            self._replace(self.region_cap, cap)
            self._replace(self.region_used, used)
            self._replace(self.region_process, per_process)

    def region_refused(self, kind: str, error: BaseException) -> bool:
        """Count one refused read of a region of ``kind`` (REGION_KINDS) if ``error`` is a
        refusal: a shim.RegionError whose reason is one of REFUSAL_REASONS. A region that was
        gone by the time it was opened, or any other error, is not counted. True if counted."""
        if kind not in REGION_KINDS:
            raise ValueError(f"region kind {kind!r}: expected one of {', '.join(REGION_KINDS)}")
        reason = getattr(error, "reason", None)
        if reason not in REFUSAL_REASONS:
            return False
        self.regions_refused.labels(kind, reason).inc()
        return True

    def _replace(self, gauge: Gauge, values: Mapping[tuple[str, ...], float]) -> None:
        """Set every label set in ``values`` and remove the ones set last time but not now
        (new values first, so a scrape never sees the group empty). Caller holds _lock."""
        for labels, value in values.items():
            gauge.labels(*labels).set(value)
        for stale in self._label_sets.get(id(gauge), set()) - values.keys():
            gauge.remove(*stale)
        self._label_sets[id(gauge)] = set(values)

    def scrape(self) -> bytes:
        """The registry in Prometheus text format (what GET /metrics returns)."""
        return generate_latest(self.registry)


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
    except Exception as e:  # a broken probe must answer 503, not drop the connection
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
        self.host: str = httpd.server_address[0]
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
