"""Device health for the kubelet: the DRAResourceHealth service (KEP-4680), served on the DRA
socket in its two packages, ``v1`` (k8s.io/kubelet/pkg/apis/dra-health/v1, May 2026) and
``v1alpha1`` (1.34-1.36 kubelets), from the supervisor's health board.

A device is

- **unhealthy** while NVML no longer lists its GPU (a prepared claim still names it), the MPS
  daemon is down (exited, killed as hung or as an impostor's victim, restarting), not yet
  configured, or an MPS server of its GPU is in FAULT;
- **unknown** while health checks have been inconclusive for verdictTimeout (another front-end
  holds the daemon: nobody can tell);
- **healthy** otherwise, again as soon as the board recovers.

The kubelet keeps one NodeWatchResources stream per plugin; each response is the complete list
(a device left out becomes unknown after its timeout, pkg/kubelet/cm/dra/healthinfo.go). The
stream sends at once, then on every change, and again every RESEND_INTERVAL so that no device
reaches its ``health_check_timeout_seconds`` while mpsd runs. ``device_health`` is pure.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import grpc

from ..lifecycle.health import HealthBoard, HealthState
from . import devices as dv
from . import dra_health_v1_pb2, dra_health_v1_pb2_grpc, dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc

log = logging.getLogger(__name__)

HEALTHY, UNHEALTHY, UNKNOWN = "healthy", "unhealthy", "unknown"
HEALTHS = (HEALTHY, UNHEALTHY, UNKNOWN)
SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")  # registration's supported_versions
TIMEOUT_SECONDS = 30  # health_check_timeout_seconds: the kubelet's default, stated
RESEND_INTERVAL = 10.0  # a third of the timeout: two lost rounds still leave the kubelet a fresh one
WAKE_INTERVAL = 1.0  # NVML's GPU list is not on the board: looked at this often
MAX_STREAMS = 2  # the kubelet keeps one; each holds a server thread of the DRA socket
MAX_MESSAGE = 1024  # characters the kubelet keeps


@dataclass(frozen=True)
class DeviceHealth:
    device: str  # its name in the node's pool
    health: str  # one of HEALTHS
    message: str = ""


def _message(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."


def gpu_verdict(state: HealthState, index: int) -> tuple[str, str]:
    """(health, why) of a GPU that NVML lists, from the board."""
    if not state.daemon_up:
        return UNHEALTHY, _message(f"MPS daemon down: {state.last_error or 'starting'}")
    if not state.configured:
        return UNHEALTHY, "MPS daemon not configured yet"
    if index in state.faulted_gpus:
        return UNHEALTHY, _message(f"MPS server of GPU {index} in FAULT: {state.last_error}")
    if state.unverified:
        return UNKNOWN, _message(f"no health verdict: {state.unverified}")
    return HEALTHY, ""


def gpu_devices(index: int, mode: str, slices_per_gpu: int) -> list[str]:
    """The names of a GPU's devices in the pool (mpsd/dra/devices.py)."""
    if mode == "slices":
        return [dv.device_name(index, k) for k in range(slices_per_gpu)]
    return [dv.device_name(index)]


def device_health(state: HealthState, gpus: Iterable, claims: Iterable, mode: str,
                  slices_per_gpu: int) -> list[DeviceHealth]:
    """Every device of the pool (``gpus``: those NVML lists, MIG ones left out as the slices
    leave them out) and every device a prepared claim (``claims``: PreparedClaim) names on a GPU
    NVML no longer lists, sorted by name."""
    out: dict[str, DeviceHealth] = {}
    listed = {g.uuid for g in gpus if not getattr(g, "mig_enabled", False)}
    for g in gpus:
        if g.uuid in listed:
            health, why = gpu_verdict(state, g.index)
            out.update({name: DeviceHealth(name, health, why) for name in gpu_devices(g.index, mode, slices_per_gpu)})
    for claim in claims:
        gone = {g.index: g.uuid for g in claim.gpus if g.uuid not in listed}
        for r in claim.results:
            try:
                index, _ = dv.parse_device_name(r.device)
            except ValueError:
                continue
            if index in gone and r.device not in out:
                out[r.device] = DeviceHealth(r.device, UNHEALTHY, f"NVML no longer lists GPU {index} ({gone[index]})")
    return [out[name] for name in sorted(out)]


class HealthSource:
    """The current list, computed from the board, the GPUs NVML lists and the prepared claims."""

    def __init__(self, board: HealthBoard, gpus: Callable[[], Sequence], claims: Callable[[], Sequence],
                 mode: str, slices_per_gpu: int, metrics=None) -> None:
        self.board, self.gpus, self.claims = board, gpus, claims
        self.mode, self.slices_per_gpu, self.metrics = mode, slices_per_gpu, metrics
        self._streams = 0
        self._lock = threading.Lock()

    def now(self) -> list[DeviceHealth]:
        return device_health(self.board.current(), self.gpus(), self.claims(), self.mode, self.slices_per_gpu)

    def publish_metrics(self) -> list[DeviceHealth]:
        rows = self.now()
        if self.metrics is not None:
            self.metrics.set_dra_device_health({r.device: r.health for r in rows})
        return rows

    def admit(self) -> bool:
        with self._lock:
            if self._streams >= MAX_STREAMS:
                return False
            self._streams += 1
            self._set_streams()
            return True

    def release(self) -> None:
        with self._lock:
            self._streams -= 1
            self._set_streams()

    def _set_streams(self) -> None:
        if self.metrics is not None:
            self.metrics.set_dra_health_streams(self._streams)


class HealthServicer:
    """NodeWatchResources for one package of the API (``pb2``)."""

    def __init__(self, pb2, source: HealthSource, pool: str, stop: threading.Event,
                 resend_interval: float = RESEND_INTERVAL, wake_interval: float = WAKE_INTERVAL) -> None:
        self.pb2, self.source, self.pool, self.stop = pb2, source, pool, stop
        self.resend_interval, self.wake_interval = resend_interval, wake_interval

    def NodeWatchResources(self, request, context):
        if not self.source.admit():
            log.warning("NodeWatchResources refused: %d streams open already", MAX_STREAMS)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"too many NodeWatchResources streams: {MAX_STREAMS} open already (the kubelet needs one)")
        try:
            yield from self._watch(context)
        finally:
            self.source.release()

    def _watch(self, context):
        state, last, sent_at = self.source.board.current(), None, 0.0
        while not self.stop.is_set() and context.is_active():
            rows = self.source.now()
            if rows != last or time.monotonic() - sent_at >= self.resend_interval:
                if rows != last:
                    log.info("device health sent package=%s devices=%d unhealthy=%d unknown=%d",
                             self.pb2.DESCRIPTOR.package, len(rows), sum(r.health == UNHEALTHY for r in rows),
                             sum(r.health == UNKNOWN for r in rows))
                if self.source.metrics is not None:
                    self.source.metrics.dra_health_sent()
                last, sent_at = rows, time.monotonic()
                yield self._response(rows)
            state = self.source.board.wait_change(state.generation, timeout=self.wake_interval)

    def _response(self, rows: list[DeviceHealth]):
        pb2, now = self.pb2, int(time.time())
        status = {HEALTHY: pb2.HEALTHY, UNHEALTHY: pb2.UNHEALTHY, UNKNOWN: pb2.UNKNOWN}
        return pb2.NodeWatchResourcesResponse(devices=[
            pb2.DeviceHealth(device=pb2.DeviceIdentifier(pool_name=self.pool, device_name=r.device),
                             health=status[r.health], last_updated_time=now,
                             health_check_timeout_seconds=TIMEOUT_SECONDS, message=r.message)
            for r in rows])


def add_to_server(server: grpc.Server, source: HealthSource, pool: str, stop: threading.Event, **kw) -> None:
    """Both packages of the service on ``server`` (the DRA socket's)."""
    dra_health_v1_pb2_grpc.add_DRAResourceHealthServicer_to_server(
        HealthServicer(dra_health_v1_pb2, source, pool, stop, **kw), server)
    dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(
        HealthServicer(dra_health_v1alpha1_pb2, source, pool, stop, **kw), server)
