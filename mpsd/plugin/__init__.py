"""The kubelet device plugin: GPUs cut into slices, handed to containers with MPS limits.

Entry point (``mpsd run`` calls it when devicePlugin.enabled)::

    run_plugin(config, *, pipe_dir, gpus, board, metrics, shim_library, stop, state_dir=None, started=None)

- ``config``: a ``mpsd.config.DevicePluginConfig`` (or the whole ``Config``, whose
  ``device_plugin`` and ``state_dir`` are then used): resource_name, slices_per_gpu,
  kubelet_dir, pod_resources_socket, region_dir, shim_host_dir, ipc_mode, shm_dir.
- ``pipe_dir``: the MPS pipe directory, mounted into pods at the same path.
- ``gpus``: inventory GPUs (``index``, ``uuid``, ``memory_total`` in bytes).
- ``board``: the supervisor's HealthBoard; slices are Unhealthy while the daemon is down or
  not configured, or their GPU is faulted, and Healthy again when it recovers.
- ``metrics``: ``mpsd.registry.Metrics`` or None; per-allocation usage goes to
  ``metrics.set_allocations`` every ``usage_interval`` seconds.
- ``shim_library``: path of libmpsshim.so, installed atomically into shim_host_dir.
- ``stop``: blocks until this event is set, then shuts down (ListAndWatch streams end).
- ``started``: set once the socket is served (``mpsd run``'s /readyz waits for it).
- ``state_dir``: where ``device-plugin-state.json`` lives (default: config.state_dir for a
  whole Config, else the parent of region_dir).
- ``instance``: this mpsd's name for its socket (default ``POD_UID``, mpsd/alloc/served.py):
  ``mpsd-<resource>-<uid>.sock``, so the old and the new pod of a rolling update (maxSurge)
  serve side by side. The new one registers at once and the kubelet moves Allocate to it; when
  the old one stops, the kubelet's device manager marks the resource's devices unhealthy
  (manager.go PluginDisconnected, for whichever endpoint is current) and, before 1.33,
  disconnects the current client: each instance therefore registers again as soon as the
  socket of another instance of the same resource goes away, which brings a fresh ListAndWatch
  and healthy devices back.

Raises PluginError when it cannot start (shim missing, socket directory unusable). Tests
construct ``DevicePlugin`` directly with explicit paths.

Modules: ``slicing`` (pure arithmetic), ``response`` (env and mounts), ``servicer`` (gRPC
service), ``kubelet`` (Registration and pod-resources clients), ``state`` (allocations on
disk), ``usage`` (labels, garbage collection, metrics).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Callable, Sequence

from .. import grpcready  # noqa: F401  (first: one line, not a traceback, if grpcio is too old)

from ..errors import PluginError
from ..lifecycle.health import HealthBoard
from . import api_pb2_grpc
from .kubelet import KUBELET_SOCKET, check_resource_name, register
from ..alloc.served import socket_identity
from ..alloc.container import HostPaths
from ..alloc.shimfile import install_shim
from ..alloc.served import ServedSocket, instance_id, remove_stale_sockets
from .servicer import UNARY_WORKERS, Servicer
from ..alloc.allocdir import restore_region_dir
from ..sharing import Backend, SliceRequest
from ..sharing.burst import burst_limits
from ..sharing.v2 import V2Backend
from ..alloc.slicing import GpuLike, Plan, advertised_ids, plan_allocation
from ..alloc.state import StateStore
from .usage import UsageMetrics, UsageTracker
from ..alloc.usage import UsageReader, shim_usage

log = logging.getLogger(__name__)

STATE_FILE = "device-plugin-state.json"
SETTLE = 0.5  # seconds between the end of the kubelet's streams and the socket's, with another instance up

__all__ = ["DevicePlugin", "run_plugin", "socket_name_for"]


def socket_name_for(resource_name: str, instance: str = "") -> str:
    """Our socket's file name in kubeletDir: ``mpsd.io/gpu`` -> ``mpsd-mpsd.io_gpu.sock``, with an
    ``instance`` ``mpsd-mpsd.io_gpu-<instance>.sock``."""
    base = "mpsd-" + resource_name.replace("/", "_")
    return f"{base}-{instance}.sock" if instance else base + ".sock"


def _peer_sockets(kubelet_dir: str, resource_name: str, own: str) -> set[tuple[str, tuple[int, int] | None]]:
    """(path, identity) of the sockets of other mpsd instances of ``resource_name`` in kubeletDir."""
    base = "mpsd-" + resource_name.replace("/", "_")
    try:
        names = os.listdir(kubelet_dir)
    except OSError:
        return set()
    paths = [os.path.join(kubelet_dir, n) for n in names
             if n != own and n.endswith(".sock") and (n == base + ".sock" or n.startswith(base + "-"))]
    return {(p, socket_identity(p)) for p in paths}


class DevicePlugin:
    def __init__(
        self,
        *,
        gpus: Sequence[GpuLike],
        resource_name: str,
        slices_per_gpu: int,
        kubelet_dir: str,
        paths: HostPaths,
        state_path: str,
        board: HealthBoard,
        shim_library: str | None = None,
        pod_resources_socket: str | None = None,
        metrics: UsageMetrics | None = None,
        usage_reader: UsageReader = shim_usage,
        socket_name: str | None = None,
        instance: str = "",
        poll_interval: float = 0.5,
        usage_interval: float = 10.0,
        gc_grace: float = 60.0,
        register_timeout: float = 5.0,
        wake_interval: float = 0.5,
        backend: Backend | None = None,
        memory_hard: Callable[[Plan], dict[int, int]] | None = None,
        gpu_source: Callable[[], Sequence[GpuLike]] | None = None,
    ) -> None:
        advertised_ids(gpus, slices_per_gpu)  # validates N and the ID lengths up front
        check_resource_name(resource_name)
        self.gpus = list(gpus)
        self.resource_name = resource_name
        self.slices_per_gpu = slices_per_gpu
        self.kubelet_dir = kubelet_dir
        self.paths = paths
        self.board = board
        self.shim_library = shim_library
        self.socket_name = socket_name or socket_name_for(resource_name, instance)
        self.socket_path = os.path.join(kubelet_dir, self.socket_name)
        self.kubelet_socket = os.path.join(kubelet_dir, KUBELET_SOCKET)
        self.poll_interval = poll_interval
        self.usage_interval = usage_interval
        self.register_timeout = register_timeout
        self.store = StateStore(state_path)
        self.backend = backend or V2Backend(paths)  # what a slice becomes on this node (mpsd/sharing)
        self.memory_hard = memory_hard or (lambda plan: {})  # devicePlugin.memoryLimit: the burst limits
        self.tracker = UsageTracker(
            store=self.store,
            region_root=paths.region_dir,
            resource_name=resource_name,
            gpu_index={g.uuid: g.index for g in gpus},
            pod_resources_socket=pod_resources_socket,
            metrics=metrics,
            usage_reader=usage_reader,
            gc_grace=gc_grace,
            on_release=self.backend.release,
        )
        self._stop = threading.Event()
        self.servicer = Servicer(
            gpus=self.gpus,
            slices_per_gpu=slices_per_gpu,
            board=board,
            paths=paths,
            store=self.store,
            stop=self._stop,
            wake_interval=wake_interval,
            backend=self.backend,
            request_for=self.request_for,
            gpu_source=gpu_source,
        )
        # streams hold a thread each while open: the pool has room for all of them and the short calls
        self._socket = ServedSocket(
            self.socket_path,
            lambda server: api_pb2_grpc.add_DevicePluginServicer_to_server(self.servicer, server),
            self.servicer.max_streams + UNARY_WORKERS,
            what="plugin socket",
            thread_prefix="mpsd-plugin-rpc",
        )
        self._registered_with: tuple[int, int] | None = None
        self._peers: set[tuple[str, tuple[int, int] | None]] = set()  # other instances' sockets seen last round
        self._last_register_error = ""
        self._threads: list[threading.Thread] = []
        self.registrations = 0  # successful Register calls, for tests and logs

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self.shim_library:
            dest = install_shim(self.shim_library, self.paths.shim_host_dir)
            log.info("shim installed source=%s dest=%s", self.shim_library, dest)
        if os.path.realpath(self.store.path).startswith(os.path.realpath(self.paths.region_dir) + os.sep):
            raise PluginError(
                f"state file {self.store.path} is inside regionDir {self.paths.region_dir}: expected a directory "
                "pods cannot write (stateDir outside regionDir)"
            )
        self.store.load()
        self.store.compact()  # a fresh snapshot and an empty journal; fails here, not in Allocate
        os.makedirs(self.paths.region_dir, mode=0o755, exist_ok=True)
        from . import regionfs  # here: `python -m mpsd.plugin.regionfs` must not find it imported

        _log_bound(regionfs, "regionDir", self.paths.region_dir, "256Mi", "the DaemonSet")
        if self.paths.ipc_mode == "tmpfs":  # every GPU pod's /dev/shm, shared read-write
            _log_bound(regionfs, "shmDir", self.paths.shm_dir, "1Gi --mode 1777 --label shmDir",
                       "deploy/overlays/tmpfs")
        for allocation in self.store.all():
            restore_region_dir(allocation, self.paths.region_dir)
        self.backend.adopt(self._requests())  # e.g. MPS v3: the namespaces of the journaled allocations
        remove_stale_sockets([p for p, _ in _peer_sockets(self.kubelet_dir, self.resource_name, self.socket_name)])
        self._peers = _peer_sockets(self.kubelet_dir, self.resource_name, self.socket_name)
        self._socket.serve()
        self.check()
        loops = [("mpsd-plugin-watch", self._watch_loop)]
        if self.usage_interval > 0:  # 0: no background rounds (tests call tracker.tick)
            loops.append(("mpsd-plugin-usage", self._usage_loop))
        for name, target in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info(
            "device plugin started resource=%s socket=%s gpus=%d slices_per_gpu=%d allocations=%d",
            self.resource_name, self.socket_path, len(self.gpus), self.slices_per_gpu, len(self.store.all()),
        )

    def stop(self) -> None:
        """Stop serving. The kubelet's streams end first, while the socket is still there: the
        kubelet marks the resource unhealthy when a stream ends, and another instance registers
        again when the socket goes, so its fresh device list is the last word (gRPC unlinks the
        socket as soon as the server stops, before its streams have seen the stop)."""
        self._stop.set()
        if not self.servicer.streams_ended(self.servicer.wake_interval + 1.0):
            log.warning("ListAndWatch streams still open after the stop; stopping the server under them")
        elif _peer_sockets(self.kubelet_dir, self.resource_name, self.socket_name):
            time.sleep(SETTLE)  # another instance registers again once the socket goes: the kubelet's verdict first
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()
        self._socket.stop()
        self.store.close()
        log.info("device plugin stopped resource=%s", self.resource_name)

    def run(self, stop: threading.Event, started: threading.Event | None = None) -> None:
        """Serve until ``stop``; ``started`` is set once the socket is served."""
        try:
            self.start()
            if started is not None:
                started.set()
            stop.wait()
        finally:
            self.stop()  # also after a failed start: nothing is left serving

    # -- one round of the watchdog (tests call it directly) -------------------------------

    def check(self) -> None:
        """Re-create our socket if it was deleted; (re-)register when the kubelet's socket is new,
        or when another instance's socket went away (see the module docstring)."""
        if self._socket.check():
            self._registered_with = None
        peers = _peer_sockets(self.kubelet_dir, self.resource_name, self.socket_name)
        if self._peers - peers and self._registered_with is not None:
            log.info("another instance's socket went away, registering again resource=%s socket=%s",
                     self.resource_name, ",".join(sorted(p for p, _ in self._peers - peers)))
            self._registered_with = None
        self._peers = peers
        kubelet = socket_identity(self.kubelet_socket)
        if kubelet is None:
            if self._registered_with is not None:
                log.warning("kubelet socket gone, waiting for it path=%s", self.kubelet_socket)
            self._registered_with = None
            return
        if kubelet == self._registered_with:
            return
        try:
            register(
                self.kubelet_socket,
                endpoint=self.socket_name,
                resource_name=self.resource_name,
                timeout=self.register_timeout,
            )
        except PluginError as exc:
            if str(exc) != self._last_register_error:
                log.warning("%s (retrying every %.1fs)", exc, self.poll_interval)
            self._last_register_error = str(exc)
            return
        self._registered_with = kubelet
        self._last_register_error = ""
        self.registrations += 1
        log.info(
            "registered with kubelet resource=%s endpoint=%s count=%d",
            self.resource_name,
            self.socket_name,
            self.registrations,
        )

    # -- the sharing backend -----------------------------------------------------------------

    def request_for(self, plan: Plan, region_dir: str) -> SliceRequest:
        """What Allocate asks the backend for: the plan, under the allocation's ID."""
        return SliceRequest(plan.allocation_id, plan, region_dir, memory_hard=self.memory_hard(plan))

    def _requests(self) -> list[SliceRequest]:
        """The stored allocations as requests (their plans computed again from the device IDs;
        one whose GPU is gone is left out with one line, and collected when no pod holds it)."""
        requests = []
        for a in self.store.all():
            try:
                plan = plan_allocation(list(a.device_ids), self.servicer.gpus, self.slices_per_gpu)
            except PluginError as exc:
                log.warning("stored allocation not given to the backend allocation=%s error=%s", a.allocation_id, exc)
                continue
            requests.append(self.request_for(plan, a.region_dir))
        return requests

    # -- internals -------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        last_error = ""
        while not self._stop.wait(self.poll_interval):
            try:
                self.check()
                last_error = ""
            except PluginError as exc:  # e.g. the socket directory is gone: retried, logged once
                if str(exc) != last_error:
                    log.error("%s (retrying every %.1fs)", exc, self.poll_interval)
                last_error = str(exc)
            except Exception:  # the watchdog must outlive any one failure
                log.exception("device plugin watchdog round failed")

    def _usage_loop(self) -> None:
        while True:
            try:
                self.tracker.tick()
            except Exception:
                log.exception("device plugin usage round failed")
            if self._stop.wait(self.usage_interval):
                return


def run_plugin(
    config,
    *,
    pipe_dir: str,
    gpus: Sequence[GpuLike],
    board: HealthBoard,
    metrics: UsageMetrics | None,
    shim_library: str,
    stop: threading.Event,
    state_dir: str | None = None,
    backend: Backend | None = None,
    started: threading.Event | None = None,
) -> None:
    """Serve the device plugin until ``stop`` is set (see the module docstring); ``started`` is
    set once it serves (mpsd run's /readyz waits for it)."""
    dp = getattr(config, "device_plugin", config)
    if state_dir is None:
        state_dir = getattr(config, "state_dir", None) or os.path.dirname(os.path.abspath(dp.region_dir))
    paths = HostPaths(
        pipe_dir=pipe_dir,
        region_dir=dp.region_dir,
        shim_host_dir=dp.shim_host_dir,
        ipc_mode=dp.ipc_mode,
        shm_dir=dp.shm_dir,
    )
    plugin = DevicePlugin(
        gpus=gpus,
        resource_name=dp.resource_name,
        slices_per_gpu=dp.slices_per_gpu,
        kubelet_dir=dp.kubelet_dir,
        paths=paths,
        state_path=os.path.join(state_dir, STATE_FILE),
        board=board,
        shim_library=shim_library,
        pod_resources_socket=dp.pod_resources_socket or None,
        metrics=metrics,
        usage_reader=functools.partial(shim_usage, library=shim_library),
        backend=backend,
        memory_hard=burst_limits(getattr(dp, "memory_limit", ""), gpus),
        instance=instance_id(),
    )
    if getattr(dp, "memory_limit", "") and plugin.backend.burst_problem():
        raise PluginError(f"devicePlugin.memoryLimit {dp.memory_limit} cannot be enforced on this node: "
                          f"{plugin.backend.burst_problem()}")
    plugin.run(stop, started)


def _log_bound(regionfs, label: str, path: str, args: str, example: str) -> None:
    """One line at start: the tmpfs that bounds what pods write at ``path``, or a warning."""
    bound = regionfs.describe(path)
    if bound is None:
        log.warning(
            "%s %s is not a tmpfs of its own: what pods write there is bounded only by the file "
            "system it is on (mount one: python -m mpsd.plugin.regionfs %s %s, as %s does)",
            label, path, path, args, example,
        )
    else:
        log.info("%s %s is a %s", label, path, bound)
