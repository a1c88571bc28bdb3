"""The DRA kubelet plugin: two gRPC servers on unix sockets, thin over mpsd.dra.prepared.

- ``<registryDir>/<driver>-reg.sock``: pluginregistration.Registration. The kubelet's plugin
  watcher finds the socket, calls GetInfo (type DRAPlugin, name = the driver, endpoint = the
  DRA socket's absolute path, supported versions ``v1.DRAPlugin`` then ``v1beta1.DRAPlugin``:
  the kubelet takes the first it knows) and reports with NotifyRegistrationStatus. Removing
  the socket deregisters the plugin.
- ``<pluginsDir>/<driver>/dra.sock``: the DRAPlugin service, v1 and v1beta1 (same messages, two
  packages). NodePrepareResources answers every claim of the request: its CDI device, or a
  one-line error in its entry (the kubelet asks again for those). With a health source, the
  DRAResourceHealth service too, v1 and v1alpha1 (mpsd/dra/devicehealth.py), listed in the
  registration's supported versions as the kubelet looks for it.

A watchdog serves a socket again when it was deleted or replaced (the kubelet's directories
may be wiped while mpsd runs).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent import futures
from typing import Callable

import grpc

from ..errors import DraError, MpsdError, one_line
from ..plugin.served import ServedSocket
from . import (
    cdi,
    devicehealth,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_pb2,
    pluginregistration_pb2_grpc,
)
from .claims import ClaimRef
from .devices import parse_device_name
from .claimusage import ClaimUsageReader
from .prepared import PreparedClaim, Preparer

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
DRA_SOCKET = "dra.sock"
WORKERS = 8  # claims of one call prepared at once (each may wait on the API server)


def registration_socket_name(driver: str) -> str:
    return f"{driver}-reg.sock"


def _devices(pb2, rec: PreparedClaim, nvidia: dict[int, str] | None = None) -> list:
    """One response Device per allocated device; the request's CDI ID on its first device, so a
    container naming the request gets that request's GPUs and limits, and one naming the whole
    claim gets every request's (a record written before requests had devices of their own has
    one ID for the claim, on the first device of each request). ``nvidia``: GPU index -> the
    ID of NVIDIA's own CDI device for it (mpsd/dra/nvidiacdi.py), given on the first device of
    each request on that GPU."""
    seen: set[str] = set()
    given: set[tuple[str, int]] = set()
    devices = []
    for r in rec.results:
        ids = [] if r.request in seen else [cdi.device_id(rec.uid, r.request if rec.requests else None)]
        seen.add(r.request)
        index = _gpu_index(r.device)
        if nvidia and index in nvidia and (r.request, index) not in given:
            given.add((r.request, index))
            ids.append(nvidia[index])
        device = pb2.Device(request_names=[r.request] if r.request else [], pool_name=r.pool,
                            device_name=r.device, cdi_device_ids=ids)
        if r.share_id and "share_id" in pb2.Device.DESCRIPTOR.fields_by_name:  # v1 only (1.35)
            device.share_id = r.share_id
        devices.append(device)
    return devices


def _gpu_index(device: str) -> int | None:
    try:
        return parse_device_name(device)[0]
    except ValueError:
        return None


class DraServicer:
    """NodePrepareResources and NodeUnprepareResources for one package of the API (``pb2``)."""

    def __init__(self, pb2, preparer: Preparer, pool: futures.Executor) -> None:
        self.pb2 = pb2
        self.preparer = preparer
        self.pool = pool

    def NodePrepareResources(self, request, context):
        response = self.pb2.NodePrepareResourcesResponse()
        refs = _refs(request)
        outcomes = self.preparer.prepare_many(list(refs.values()), map_fn=self.pool.map)
        for uid, outcome in outcomes.items():
            if isinstance(outcome, str):
                log.error("NodePrepareResources claim=%s error=%s", refs[uid], outcome)
                response.claims[uid].error = outcome
            else:
                response.claims[uid].devices.extend(_devices(self.pb2, outcome, self.preparer.nvidia_ids(outcome)))
        return response

    def NodeUnprepareResources(self, request, context):
        response = self.pb2.NodeUnprepareResourcesResponse()
        refs = _refs(request)
        for uid, error in self.preparer.unprepare_many(list(refs.values())).items():
            response.claims[uid].SetInParent()
            if error:
                log.error("NodeUnprepareResources claim=%s error=%s", refs[uid], error)
                response.claims[uid].error = error
        return response


def _refs(request) -> dict[str, ClaimRef]:
    return {c.uid: ClaimRef(c.namespace, c.name, c.uid) for c in request.claims}


class RegistrationServicer(pluginregistration_pb2_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: str, versions: tuple[str, ...] = SUPPORTED_VERSIONS) -> None:
        self.driver, self.endpoint, self.versions = driver, endpoint, versions
        self.status: tuple[bool, str] | None = None  # the kubelet's last verdict
        self.notified = threading.Event()
        self.on_registered: Callable[[], None] = lambda: None  # e.g. the slice publisher's invalidate

    def GetInfo(self, request, context):
        return pluginregistration_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=self.driver, endpoint=self.endpoint, supported_versions=list(self.versions)
        )

    def NotifyRegistrationStatus(self, request, context):
        self.status = (request.plugin_registered, request.error)
        if request.plugin_registered:
            log.info("registered with the kubelet driver=%s endpoint=%s", self.driver, self.endpoint)
            self.on_registered()
        else:
            log.error("kubelet refused the registration driver=%s error=%s", self.driver, one_line(request.error))
        self.notified.set()
        return pluginregistration_pb2.RegistrationStatusResponse()


class DraPlugin:
    def __init__(self, preparer: Preparer, *, plugins_dir: str, registry_dir: str, poll_interval: float = 1.0,
                 usage: ClaimUsageReader | None = None, usage_interval: float = 10.0,
                 health: devicehealth.HealthSource | None = None, health_options: dict | None = None):
        """``health``: the device health served to the kubelet (DRAResourceHealth v1 and v1alpha1
        on the DRA socket, listed in the registration) and on /metrics."""
        driver = preparer.driver
        self.preparer, self.health = preparer, health
        self._stop = threading.Event()
        self.poll_interval = poll_interval
        self.usage, self.usage_interval = usage, usage_interval  # per-claim metrics, every usage_interval
        self.socket_path = os.path.abspath(os.path.join(plugins_dir, driver, DRA_SOCKET))
        self.registration_path = os.path.abspath(os.path.join(registry_dir, registration_socket_name(driver)))
        versions = SUPPORTED_VERSIONS + (devicehealth.SERVICES if health is not None else ())
        self.registration = RegistrationServicer(driver, self.socket_path, versions)
        self._pool = futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="mpsd-dra-claim")
        v1 = DraServicer(dra_v1_pb2, preparer, self._pool)
        v1beta1 = DraServicer(dra_v1beta1_pb2, preparer, self._pool)

        def add_dra(server: grpc.Server) -> None:
            dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(v1, server)
            dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(v1beta1, server)
            if health is not None:
                devicehealth.add_to_server(server, health, preparer.pool, self._stop, **(health_options or {}))

        def add_registration(server: grpc.Server) -> None:
            pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(self.registration, server)

        sockets = dict(what="socket", thread_prefix="mpsd-dra-rpc", error=DraError, dir_mode=0o750)
        streams = devicehealth.MAX_STREAMS if health is not None else 0  # each holds a thread
        self._dra = ServedSocket(self.socket_path, add_dra, WORKERS + 2 + streams, **sockets)
        self._reg = ServedSocket(self.registration_path, add_registration, 2, **sockets)
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Converge the prepared claims, then serve: the DRA socket before the registration socket
        (the kubelet calls the endpoint as soon as it has registered it)."""
        self.preparer.store.load()
        self.preparer.store.compact()
        self.preparer.cdi.check()
        self.preparer.recover()
        self._dra.serve()
        self._reg.serve()
        loops = [("mpsd-dra-watch", self._watch)]
        if self.usage is not None:
            loops.append(("mpsd-dra-usage", self._usage_loop))
        for name, target in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("DRA plugin started driver=%s node=%s socket=%s registration=%s prepared=%d",
                 self.preparer.driver, self.preparer.node, self.socket_path, self.registration_path,
                 len(self.preparer.prepared()))

    def stop(self) -> None:
        """Deregister (the registration socket goes first), stop serving; prepared claims stay."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()
        self._reg.stop()
        self._dra.stop()
        self._pool.shutdown(wait=True)
        self.preparer.store.close()
        log.info("DRA plugin stopped driver=%s", self.preparer.driver)

    def check(self) -> None:
        self._dra.check()
        self._reg.check()

    def _usage_loop(self) -> None:
        while True:
            try:
                self.usage.tick()
            except Exception:
                log.exception("DRA claim usage round failed")
            if self._stop.wait(self.usage_interval):
                return

    def _watch(self) -> None:
        last = ""
        while not self._stop.wait(self.poll_interval):
            try:
                if self.health is not None:
                    self.health.publish_metrics()
                self.check()
                last = ""
            except MpsdError as exc:
                if str(exc) != last:
                    log.error("%s (retrying every %.1fs)", exc, self.poll_interval)
                last = str(exc)
            except Exception:
                log.exception("DRA plugin watchdog round failed")
