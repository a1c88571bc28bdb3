"""The DRA kubelet plugin: two gRPC servers on unix sockets, thin over mpsd.dra.prepared.

- ``<registryDir>/<driver>-reg.sock``: pluginregistration.Registration. The kubelet's plugin
  watcher finds the socket, calls GetInfo (type DRAPlugin, name = the driver, endpoint = the
  DRA socket's absolute path, supported versions ``v1.DRAPlugin`` then ``v1beta1.DRAPlugin``:
  the kubelet takes the first it knows) and reports with NotifyRegistrationStatus. Removing
  the socket deregisters the plugin.
- ``<pluginsDir>/<driver>/dra.sock``: the DRAPlugin service, v1 and v1beta1 (same messages, two
  packages). NodePrepareResources answers every claim of the request: its CDI device, or a
  one-line error in its entry (the kubelet asks again for those). At most PREPARE_SLOTS
  Prepare calls run at once (each may wait on the API server for its whole timeout); one more
  is answered "busy" at once, so Unprepare, which needs no API call, always finds a thread.
  With a health source, the DRAResourceHealth service too, v1 and v1alpha1
  (mpsd/dra/devicehealth.py), listed in the registration's supported versions as the kubelet
  looks for it.

Seamless upgrades (``instance``, the pod's UID: mpsd/alloc/served.py). Kubelets since 1.33
keep every registered instance of a driver, each under its own endpoint, and call the newest
one that is connected (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go: ``add`` refuses a
second registration of one endpoint, ``get`` prefers the most recent connected plugin); they
wipe a driver's ResourceSlices only when none is connected for 30 s. So each instance names
its sockets after itself, ``<driver>-<uid>-reg.sock`` (shortened to a hash of the UID, then of
driver and UID, where the path would not fit a socket address, as the DRA helper's
RollingUpdateRegistrarSocketFile chooses) and ``dra-<uid>.sock``, and the old and the new
mpsd of a DaemonSet with ``maxSurge`` overlap: the kubelet moves to the new one when it
registers, and the old one finishes its calls and goes. Either may be asked to unprepare what
the other prepared: every call takes ``<pluginsDir>/<driver>/serialize.lock`` (flock, as the
helper's Serialize does across instances) and the state store reads again what the other
wrote (mpsd/alloc/state.py). Sockets of earlier instances nobody serves are removed at start.

A watchdog serves a socket again when it was deleted or replaced (the kubelet's directories
may be wiped while mpsd runs).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import glob
import hashlib
import logging
import os
import threading
from concurrent import futures
from typing import Callable, ContextManager

import grpc

from ..errors import DraError, MpsdError, one_line
from ..alloc.served import UNIX_PATH_MAX, ServedSocket, remove_stale_sockets
from ..alloc.sharedlock import SharedLock
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
from .nvidiacdi import gpu_index
from .claimusage import ClaimUsageReader
from .prepared import PreparedClaim, Preparer

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
DRA_SOCKET = "dra.sock"
SERIALIZE_LOCK = "serialize.lock"
SERIALIZE_WAIT = 30.0  # inside the kubelet's 45 s call timeout
WORKERS = 8  # claims of one call prepared at once (each may wait on the API server)
PREPARE_SLOTS = WORKERS  # NodePrepareResources calls at once; one more is answered "busy" at once
RESERVED_THREADS = 2  # gRPC threads no Prepare takes: Unprepare (no API call) answers while Prepares wait


def registration_socket_name(driver: str, instance: str = "", registry_dir: str = "") -> str:
    """``<driver>-reg.sock``; with an ``instance``, the first of ``<driver>-<instance>-reg.sock``,
    ``<driver>-<hash of instance>-reg.sock`` and ``dra-<hash of driver and instance>-reg.sock``
    whose path in ``registry_dir`` fits a socket address."""
    if not instance:
        return f"{driver}-reg.sock"
    candidates = [f"{driver}-{instance}-reg.sock", f"{driver}-{_hash(instance, 8)}-reg.sock",
                  f"dra-{_hash(driver + chr(0) + instance, 16)}-reg.sock"]
    fits = [c for c in candidates if len(os.fsencode(os.path.join(os.path.abspath(registry_dir), c))) <= UNIX_PATH_MAX]
    return (fits or candidates)[0 if fits else -1]


def dra_socket_name(instance: str = "") -> str:
    return f"dra-{instance}.sock" if instance else DRA_SOCKET


def _hash(text: str, size: int) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()[:size]).decode().rstrip("=")


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
        index = gpu_index(r.device)
        if nvidia and index in nvidia and (r.request, index) not in given:
            given.add((r.request, index))
            ids.append(nvidia[index])
        device = pb2.Device(request_names=[r.request] if r.request else [], pool_name=r.pool,
                            device_name=r.device, cdi_device_ids=ids)
        if r.share_id and "share_id" in pb2.Device.DESCRIPTOR.fields_by_name:  # v1 only (1.35)
            device.share_id = r.share_id
        devices.append(device)
    return devices


class DraServicer:
    """NodePrepareResources and NodeUnprepareResources for one package of the API (``pb2``),
    each under ``serialize`` (the lock shared with other instances, or none)."""

    def __init__(self, pb2, preparer: Preparer, pool: futures.Executor,
                 slots: threading.Semaphore | None = None,
                 serialize: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        self.pb2 = pb2
        self.preparer = preparer
        self.pool = pool
        self.slots = slots  # Prepare calls at once: each may wait on the API server for its whole timeout
        self.serialize = serialize

    def NodePrepareResources(self, request, context):
        with self._serialized(context):
            return self._prepare(request)

    def NodeUnprepareResources(self, request, context):
        with self._serialized(context):
            return self._unprepare(request)

    @contextlib.contextmanager
    def _serialized(self, context):
        """The call under the lock; a lock not had in time fails the call UNAVAILABLE (the kubelet retries)."""
        try:
            lock = self.serialize()
            lock.__enter__()
        except MpsdError as exc:
            log.error("call not served: %s", exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, one_line(exc))
        try:
            yield
        finally:
            lock.__exit__(None, None, None)

    def _prepare(self, request):
        response = self.pb2.NodePrepareResourcesResponse()
        refs = _refs(request)
        if self.slots is not None and not self.slots.acquire(blocking=False):
            busy = (f"busy: {PREPARE_SLOTS} NodePrepareResources calls already wait on the API server; "
                    "nothing was prepared (the kubelet asks again)")
            log.warning("NodePrepareResources refused claims=%s error=%s", ",".join(map(str, refs.values())), busy)
            for uid in refs:
                response.claims[uid].error = busy
            return response
        try:
            outcomes = self.preparer.prepare_many(list(refs.values()), map_fn=self.pool.map)
        finally:
            if self.slots is not None:
                self.slots.release()
        for uid, outcome in outcomes.items():
            if isinstance(outcome, str):
                log.error("NodePrepareResources claim=%s error=%s", refs[uid], outcome)
                response.claims[uid].error = outcome
            else:
                response.claims[uid].devices.extend(_devices(self.pb2, outcome, self.preparer.nvidia_ids(outcome)))
        return response

    def _unprepare(self, request):
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
                 usage: ClaimUsageReader | None = None, usage_interval: float = 10.0, instance: str = "",
                 health: devicehealth.HealthSource | None = None, health_options: dict | None = None):
        """``instance``: this mpsd's name for its sockets (the pod's UID); "" for the fixed names.
        ``health``: the device health served to the kubelet (DRAResourceHealth v1 and v1alpha1
        on the DRA socket, listed in the registration) and on /metrics."""
        driver = preparer.driver
        self.preparer, self.health = preparer, health
        self.instance = instance
        self._stop = threading.Event()
        self.poll_interval = poll_interval
        self.usage, self.usage_interval = usage, usage_interval  # per-claim metrics, every usage_interval
        self.data_dir = os.path.abspath(os.path.join(plugins_dir, driver))
        self.registry_dir = os.path.abspath(registry_dir)
        self.socket_path = os.path.join(self.data_dir, dra_socket_name(instance))
        self.registration_path = os.path.join(self.registry_dir,
                                              registration_socket_name(driver, instance, registry_dir))
        versions = SUPPORTED_VERSIONS + (devicehealth.SERVICES if health is not None else ())
        self.registration = RegistrationServicer(driver, self.socket_path, versions)
        self._pool = futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="mpsd-dra-claim")
        slots = threading.BoundedSemaphore(PREPARE_SLOTS)  # shared by v1 and v1beta1: one server, one pool
        self._serialize = SharedLock(os.path.join(self.data_dir, SERIALIZE_LOCK), wait=SERIALIZE_WAIT)
        serialize = (lambda: self._serialize) if instance else contextlib.nullcontext
        v1 = DraServicer(dra_v1_pb2, preparer, self._pool, slots, serialize)
        v1beta1 = DraServicer(dra_v1beta1_pb2, preparer, self._pool, slots, serialize)

        def add_dra(server: grpc.Server) -> None:
            dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(v1, server)
            dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(v1beta1, server)
            if health is not None:
                devicehealth.add_to_server(server, health, preparer.pool, self._stop, **(health_options or {}))

        def add_registration(server: grpc.Server) -> None:
            pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(self.registration, server)

        sockets = functools.partial(ServedSocket, what="socket", thread_prefix="mpsd-dra-rpc", error=DraError,
                                    dir_mode=0o750)
        streams = devicehealth.MAX_STREAMS if health is not None else 0  # each open stream holds a thread
        self._dra = sockets(self.socket_path, add_dra, PREPARE_SLOTS + RESERVED_THREADS + streams)
        self._reg = sockets(self.registration_path, add_registration, 2)
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Converge the prepared claims (under the lock another instance's calls hold), remove
        sockets of earlier instances nobody serves, then serve: the DRA socket before the
        registration socket (the kubelet calls the endpoint as soon as it has registered it)."""
        with self._serialize if self.instance else contextlib.nullcontext():
            self.preparer.store.load()
            self.preparer.store.compact()
            self.preparer.cdi.check()
            self.preparer.recover()
        driver = self.preparer.driver
        remove_stale_sockets(
            [*glob.glob(os.path.join(glob.escape(self.registry_dir), glob.escape(driver) + "-*reg.sock")),
             *glob.glob(os.path.join(glob.escape(self.data_dir), "dra*.sock"))],
            keep=(self.socket_path, self.registration_path))
        self._dra.serve()
        self._reg.serve()
        loops = [("mpsd-dra-watch", self._watch)]
        if self.usage is not None:
            loops.append(("mpsd-dra-usage", self._usage_loop))
        for name, target in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("DRA plugin started driver=%s node=%s socket=%s registration=%s instance=%s prepared=%d",
                 self.preparer.driver, self.preparer.node, self.socket_path, self.registration_path,
                 self.instance or "-", len(self.preparer.prepared()))

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
        usage = self.usage
        while usage is not None:
            try:
                usage.tick()
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
