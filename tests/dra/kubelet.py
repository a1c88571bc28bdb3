"""A stand-in kubelet for several instances of one DRA driver at once (a rolling update with
maxSurge): its plugin watcher and DRA plugin manager, over real gRPC, as Kubernetes 1.33+ runs
them.

- Plugin watcher (pkg/kubelet/pluginmanager/pluginwatcher/README.md): every socket in the
  registry directory whose name does not start with '.' is a plugin: GetInfo, validate, register,
  NotifyRegistrationStatus; a socket that goes away is a deregistration. ``scan()`` is one round
  (the real one reacts to inotify events; a thread here scans every ``interval``).
- DRA plugin manager (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go): a driver's plugins are
  kept in registration order, a second registration of one endpoint is refused ("endpoint ...
  already registered"); each call goes to the most recently registered plugin whose gRPC
  connection is up, else to the latest (``get``); when no plugin of a driver is connected, its
  ResourceSlices are wiped after ``wiping_delay`` (30 s in the kubelet) unless one connects
  again first (``sync``, ``pendingWipes``).
- A failed NodePrepareResources or NodeUnprepareResources is tried again (the kubelet's pod
  workers retry the pod's sync): ``prepare``/``unprepare`` retry UNAVAILABLE answers for a while,
  picking the plugin anew each time.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from mpsd.dra import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_pb2,
    pluginregistration_pb2_grpc,
)

SERVICES = {"v1.DRAPlugin": (dra_v1_pb2, dra_v1_pb2_grpc), "v1beta1.DRAPlugin": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc)}
OPTIONS = [("grpc.enable_http_proxy", 0)]


@dataclass
class Plugin:
    driver: str
    endpoint: str
    socket: str  # its registration socket
    pb2: Any
    stub: Any
    channel: grpc.Channel
    connected: bool = False
    calls: int = 0


@dataclass
class Call:
    method: str
    endpoint: str
    claims: tuple[str, ...]
    error: str = ""


@dataclass
class PluginWatcher:
    registry_dir: str
    wipe: Callable[[str], None] = lambda driver: None
    wiping_delay: float = 30.0
    interval: float = 0.05
    plugins: dict[str, list[Plugin]] = field(default_factory=dict)
    registered: dict[str, Plugin] = field(default_factory=dict)  # registration socket -> plugin
    refused: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    wiped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lock = threading.RLock()
        self._pending: dict[str, threading.Timer] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.paused = threading.Event()  # set: new sockets wait (a kubelet slow to see them)

    # -- the plugin watcher ---------------------------------------------------------------

    def start(self) -> PluginWatcher:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with self.lock:
            for timer in self._pending.values():
                timer.cancel()
            for plugins in self.plugins.values():
                for p in plugins:
                    p.channel.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self.paused.is_set():
                self.scan()

    def scan(self) -> None:
        try:
            names = os.listdir(self.registry_dir)
        except FileNotFoundError:
            names = []
        present = set()
        for name in names:
            path = os.path.join(self.registry_dir, name)
            try:
                if name.startswith(".") or not stat.S_ISSOCK(os.lstat(path).st_mode):
                    continue
            except FileNotFoundError:
                continue
            present.add(path)
            if path not in self.registered and path not in self.refused:
                self._register(path)
        for path in set(self.registered) - present:
            self._deregister(path)

    def _register(self, path: str) -> None:
        channel = grpc.insecure_channel("unix://" + path, options=OPTIONS)
        try:
            reg = pluginregistration_pb2_grpc.RegistrationStub(channel)
            info = reg.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=5)
            chosen = next((s for s in info.supported_versions if s in SERVICES), None)
            error = ""
            if info.type != "DRAPlugin" or chosen is None or not info.endpoint.startswith("/"):
                error = f"plugin {info.name!r} at {info.endpoint!r}: type {info.type!r}, services {list(info.supported_versions)}"
            with self.lock:
                if not error and any(p.endpoint == info.endpoint for p in self.plugins.get(info.name, [])):
                    error = f"endpoint {info.endpoint} already registered for DRA driver plugin {info.name}"
                if not error:
                    pb2, grpc_mod = SERVICES[chosen]
                    dra = grpc.insecure_channel("unix:" + info.endpoint, options=OPTIONS)
                    plugin = Plugin(info.name, info.endpoint, path, pb2, grpc_mod.DRAPluginStub(dra), dra)
                    self.plugins.setdefault(info.name, []).append(plugin)
                    self.registered[path] = plugin
                    dra.subscribe(lambda state, p=plugin: self._connectivity(p, state), try_to_connect=True)
                else:
                    self.refused.append(path)
            reg.NotifyRegistrationStatus(
                pluginregistration_pb2.RegistrationStatus(plugin_registered=not error, error=error), timeout=5)
        except grpc.RpcError:
            pass  # not serving yet or gone again: the next round tries from scratch
        finally:
            channel.close()

    def _deregister(self, path: str) -> None:
        with self.lock:
            plugin = self.registered.pop(path)
            self.plugins[plugin.driver].remove(plugin)
            plugin.connected = False
            self._sync(plugin.driver)
        plugin.channel.close()

    # -- the DRA plugin manager -----------------------------------------------------------

    def _connectivity(self, plugin: Plugin, state: grpc.ChannelConnectivity) -> None:
        with self.lock:
            if plugin not in self.plugins.get(plugin.driver, []):
                return
            plugin.connected = state == grpc.ChannelConnectivity.READY
            self._sync(plugin.driver)

    def _sync(self, driver: str) -> None:
        if any(p.connected for p in self.plugins.get(driver, [])):
            timer = self._pending.pop(driver, None)
            if timer is not None:
                timer.cancel()
            return
        if driver not in self._pending:
            timer = threading.Timer(self.wiping_delay, self._wipe, args=(driver,))
            timer.daemon = True
            self._pending[driver] = timer
            timer.start()

    def _wipe(self, driver: str) -> None:
        with self.lock:
            if self._pending.pop(driver, None) is None:
                return
            self.wiped.append(driver)
        self.wipe(driver)

    def get(self, driver: str) -> Plugin | None:
        with self.lock:
            plugins = self.plugins.get(driver, [])
            connected = [p for p in plugins if p.connected]
            return (connected or plugins or [None])[-1]

    def wait_registered(self, driver: str, count: int, timeout: float = 20.0) -> list[Plugin]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                plugins = list(self.plugins.get(driver, []))
            if len(plugins) == count and all(p.connected for p in plugins):
                return plugins
            time.sleep(0.02)
        raise AssertionError(f"{driver}: {len(plugins)} plugins registered, expected {count}")

    # -- the calls --------------------------------------------------------------------------

    def prepare(self, driver: str, *claims: tuple[str, str, str], retry_for: float = 20.0):
        return self._call("NodePrepareResources", driver, claims, retry_for)

    def unprepare(self, driver: str, *claims: tuple[str, str, str], retry_for: float = 20.0):
        return self._call("NodeUnprepareResources", driver, claims, retry_for)

    def _call(self, method: str, driver: str, claims, retry_for: float):
        deadline = time.monotonic() + retry_for
        while True:
            plugin = self.get(driver)
            if plugin is None:
                error = f"DRA driver {driver} is not registered"
            else:
                kind = "NodePrepareResourcesRequest" if method == "NodePrepareResources" else "NodeUnprepareResourcesRequest"
                request = getattr(plugin.pb2, kind)(claims=[plugin.pb2.Claim(namespace=n, name=c, uid=u)
                                                           for n, c, u in claims])
                try:
                    reply = getattr(plugin.stub, method)(request, timeout=45)
                    plugin.calls += 1
                    with self.lock:
                        self.calls.append(Call(method, plugin.endpoint, tuple(u for _, _, u in claims)))
                    return reply
                except grpc.RpcError as exc:
                    error = f"{exc.code().name} {exc.details()}"
                    with self.lock:
                        self.calls.append(Call(method, plugin.endpoint, tuple(u for _, _, u in claims), error))
            if time.monotonic() >= deadline:
                raise AssertionError(f"{method} {claims}: {error}")
            time.sleep(0.1)
