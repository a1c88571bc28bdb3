"""Fixtures for the DRA kubelet plugin: fake GPUs, ResourceClaims as the API server returns them,
a Preparer over temporary directories, and a stand-in kubelet that registers the plugin through
its registration socket and calls the DRA service over real gRPC on unix sockets (paths in a
short temporary directory: unix socket paths are limited to 107 bytes)."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from mpsd.dra import (
    dra_health_v1_pb2,
    dra_health_v1_pb2_grpc,
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_pb2,
    pluginregistration_pb2_grpc,
)
from mpsd.dra.cdi import CdiDir
from mpsd.dra.kubeletplugin import DraPlugin
from mpsd.dra.prepared import PreparedClaim, Preparer
from mpsd.errors import MpsdError
from mpsd.alloc.container import HostPaths
from mpsd.alloc.state import StateStore

from tests.inventory.conftest import fake_nvml_lib, nvml_config  # noqa: F401 (fixtures: the fake NVML)
from tests.plugin.conftest import GIB, gpus  # noqa: F401  (the same fake GPUs as the device plugin's tests)
from tests.dra.apiserver import apiserver, kubeconfig  # noqa: F401 (fixtures: the stand-in API server and a KUBECONFIG for it)
from tests.dra.apiserver import validate

DRIVER = "gpu.mpsd.io"
NODE = "node-a"
KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # what a 1.34 kubelet knows
HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")  # a 1.37 kubelet's, preferred first
KUBELET_HEALTH_TIMEOUT = 30.0  # pkg/kubelet/cm/dra/healthinfo.go DefaultHealthTimeout


def claim(uid="uid-1", name="c1", namespace="ns", node=NODE, results=None, config=None, pods=("pod-a",)):
    """A ResourceClaim (resource.k8s.io/v1) as the API server returns it, allocated on ``node``.
    Its spec has the requests its results name: ``gpu`` an ``exactly`` request, ``gpu/large`` a
    subrequest of the ``firstAvailable`` list of request ``gpu`` (a prioritized list: the
    scheduler records which alternative it picked as ``<request>/<subrequest>``)."""
    if results is None:
        results = [result()]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
        "spec": {"devices": {"requests": spec_requests(str(r.get("request")) for r in results)}},
        "status": {
            "allocation": {
                "devices": {"results": results, "config": config or []},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
            },
            "reservedFor": [{"resource": "pods", "name": p, "uid": f"pod-uid-{p}"} for p in pods],
        },
    }


def spec_requests(names) -> list[dict]:
    """The requests of a claim spec whose results name ``names``, in their first order."""
    requests: dict[str, dict] = {}
    for name in names:
        main, _, sub = name.partition("/")
        if not sub:
            requests.setdefault(main, {"name": main, "exactly": {"deviceClassName": DRIVER}})
            continue
        request = requests.setdefault(main, {"name": main, "firstAvailable": []})
        if {"name": sub, "deviceClassName": DRIVER} not in request["firstAvailable"]:
            request["firstAvailable"].append({"name": sub, "deviceClassName": DRIVER})
    return list(requests.values())


def result(device="gpu-0", request="gpu", memory="8Gi", compute=None, driver=DRIVER, pool=NODE):
    r = {"request": request, "driver": driver, "pool": pool, "device": device}
    consumed = {k: v for k, v in (("memory", memory), ("compute", compute)) if v is not None}
    if consumed:
        r["consumedCapacity"] = consumed
    return r


def opaque(params, driver=DRIVER, source="FromClaim"):
    return {"source": source, "opaque": {"driver": driver, "parameters": params}}


class Claims:
    """The API server as the Preparer sees it: get_claim(namespace, name)."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str], dict] = {}
        self.calls = 0
        self.error: Exception | None = None

    def put(self, c: dict, valid: bool = True) -> dict:
        """``c`` as the API server would hold it: validated strictly (schema and rules), unless
        ``valid`` is False (a test of what mpsd does with an object the API server would refuse)."""
        if valid:
            errors = validate(c)
            assert not errors, f"the API server would refuse this claim: {errors}"
        self.items[(c["metadata"]["namespace"], c["metadata"]["name"])] = c
        return c

    def __call__(self, namespace: str, name: str) -> dict:
        self.calls += 1
        if self.error is not None:
            raise self.error
        try:
            return self.items[(namespace, name)]
        except KeyError:
            raise MpsdError(f"resourceclaims {namespace}/{name}: 404 Not Found") from None


@dataclass
class Env:
    root: Path
    paths: HostPaths
    cdi_dir: Path
    state_path: Path
    plugins_dir: Path
    registry_dir: Path
    claims: Claims = field(default_factory=Claims)

    def preparer(self, gpu_list=None, slices: int = 4, **kw) -> Preparer:
        return Preparer(
            driver=DRIVER, node=NODE, pool=NODE, gpus=gpu_list or gpus(80, 40), slices_per_gpu=slices,
            paths=self.paths, cdi_dir=CdiDir(str(self.cdi_dir)),
            store=StateStore(str(self.state_path), record=PreparedClaim), get_claim=self.claims,
            dev_dir=str(self.root / "dev"), **kw,
        )

    def loaded(self, **kw) -> Preparer:
        """A preparer as a (re)started mpsd has it: state loaded, converged."""
        p = self.preparer(**kw)
        p.store.load()
        p.recover()
        return p

    def plugin(self, health=None, health_options=None, **kw) -> DraPlugin:
        return DraPlugin(self.preparer(**kw), plugins_dir=str(self.plugins_dir), registry_dir=str(self.registry_dir),
                         poll_interval=0.05, health=health, health_options=health_options)


@pytest.fixture
def env() -> Iterator[Env]:
    root = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))
    (root / "dev").mkdir()
    paths = HostPaths(pipe_dir=str(root / "pipe"), region_dir=str(root / "regions"), shim_host_dir=str(root / "lib"))
    yield Env(root, paths, root / "cdi", root / "state" / "dra-state.json", root / "plugins", root / "registry")
    shutil.rmtree(root, ignore_errors=True)


class HealthWatch:
    """The kubelet's side of one plugin's DRAResourceHealth stream: the kubelet's plugin manager
    opens NodeWatchResources on the service it picked from the registration's supported versions
    (pkg/kubelet/cm/dra/plugin, pickHealthService: v1 before v1alpha1, none when neither is
    listed) and hands the stream to HandleWatchResourcesStream (pkg/kubelet/cm/dra/manager.go),
    which puts every device of each response in its cache with its own receipt time as
    LastUpdated and health_check_timeout_seconds as timeout (0 or less: 30 s); getHealthInfo
    (pkg/kubelet/cm/dra/healthinfo.go) answers unknown for a device not heard of within its
    timeout. Messages are read until the stream ends."""

    def __init__(self, channel: grpc.Channel, service: str) -> None:
        package = service.split(".")[0]
        self.pb2 = dra_health_v1_pb2 if package == "v1" else dra_health_v1alpha1_pb2
        grpc_mod = dra_health_v1_pb2_grpc if package == "v1" else dra_health_v1alpha1_pb2_grpc
        self.stream = grpc_mod.DRAResourceHealthStub(channel).NodeWatchResources(self.pb2.NodeWatchResourcesRequest())
        self.cache: dict[tuple[str, str], tuple[str, str, float, float]] = {}  # -> health, message, timeout, at
        self.responses = 0
        self.ended: grpc.RpcError | None = None  # how the stream failed, if it did
        self.done = False  # the stream is over (ended by the plugin, or failed)
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        names = {self.pb2.HEALTHY: "healthy", self.pb2.UNHEALTHY: "unhealthy"}
        try:
            for response in self.stream:
                now = time.monotonic()
                with self.cond:
                    for d in response.devices:
                        timeout = d.health_check_timeout_seconds if d.health_check_timeout_seconds > 0 \
                            else KUBELET_HEALTH_TIMEOUT
                        self.cache[(d.device.pool_name, d.device.device_name)] = (
                            names.get(d.health, "unknown"), d.message[:1024], float(timeout), now)
                    self.responses += 1
                    self.cond.notify_all()
        except grpc.RpcError as exc:
            with self.cond:
                self.ended = exc
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def health(self, pool: str, device: str) -> tuple[str, str]:
        """(health, message) as the kubelet's getHealthInfo answers it now."""
        with self.cond:
            entry = self.cache.get((pool, device))
            if entry is None or time.monotonic() - entry[3] > entry[2]:
                return "unknown", ""
            return entry[0], entry[1]

    def wait(self, predicate, timeout: float = 30.0) -> bool:
        """Until ``predicate(self)`` holds (checked after each response) or ``timeout``."""
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self), timeout)

    def close(self) -> None:
        self.stream.cancel()
        self.thread.join(10)


class StandInKubelet:
    """What the kubelet's plugin watcher and DRA manager do with a DRA plugin, over gRPC: GetInfo
    on the registration socket, check the answer as the kubelet does (type, name, an absolute
    endpoint, a service it knows: the first of the plugin's list), NotifyRegistrationStatus, then
    NodePrepareResources / NodeUnprepareResources on the endpoint."""

    def __init__(self, registration_socket: str, services=KUBELET_SERVICES) -> None:
        self.registration_socket = registration_socket
        self.services = services
        self.channels: list[grpc.Channel] = []
        self.watches: list[HealthWatch] = []
        self.info = None
        self.stub = None
        self.pb2 = None

    def _channel(self, path: str) -> grpc.Channel:
        ch = grpc.insecure_channel("unix://" + path, options=[("grpc.enable_http_proxy", 0)])
        self.channels.append(ch)
        return ch

    def register(self, driver: str = DRIVER) -> str:
        reg = pluginregistration_pb2_grpc.RegistrationStub(self._channel(self.registration_socket))
        info = reg.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=10)
        error = ""
        chosen = next((s for s in info.supported_versions if s in self.services), None)
        if info.type != "DRAPlugin":
            error = f"type {info.type!r}"
        elif info.name != driver:
            error = f"name {info.name!r}"
        elif not info.endpoint.startswith("/"):
            error = f"endpoint {info.endpoint!r} not absolute"
        elif chosen is None:
            error = f"none of {list(info.supported_versions)} supported"
        reg.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(plugin_registered=not error,
                                                                              error=error), timeout=10)
        assert not error, error
        self.info = info
        if chosen == "v1.DRAPlugin":
            self.pb2, grpc_mod = dra_v1_pb2, dra_v1_pb2_grpc
        else:
            self.pb2, grpc_mod = dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
        self.stub = grpc_mod.DRAPluginStub(self._channel(info.endpoint))  # "unix:" + endpoint, as the kubelet dials
        return chosen

    def watch_health(self, known=HEALTH_SERVICES) -> HealthWatch | None:
        """The health stream the kubelet opens after registering the plugin: on the first of
        ``known`` that the plugin lists; None (no stream) when it lists none of them."""
        service = next((s for s in known if s in self.info.supported_versions), None)
        if service is None:
            return None
        watch = HealthWatch(self._channel(self.info.endpoint), service)
        self.watches.append(watch)
        return watch

    def prepare(self, *claims: tuple[str, str, str]):
        """claims: (namespace, name, uid)"""
        req = self.pb2.NodePrepareResourcesRequest(
            claims=[self.pb2.Claim(namespace=n, name=c, uid=u) for n, c, u in claims])
        return self.stub.NodePrepareResources(req, timeout=30)

    @staticmethod
    def container_cdi_ids(entry, request: str = "") -> list[str]:
        """The CDI device IDs the kubelet hands the runtime for a container that names this claim
        (``entry``: the claim's NodePrepareResourceResponse) with ``resources.claims[].request``
        = ``request`` ("" names the whole claim): a device counts when the container names the
        whole claim, when the device names no request, or when its request_names contain the
        container's request, matched literally (pkg/kubelet/cm/dra/claiminfo.go,
        ClaimInfo.cdiDevicesAsList)."""
        return [i for d in entry.devices if not request or not d.request_names or request in d.request_names
                for i in d.cdi_device_ids]

    def unprepare(self, *claims: tuple[str, str, str]):
        req = self.pb2.NodeUnprepareResourcesRequest(
            claims=[self.pb2.Claim(namespace=n, name=c, uid=u) for n, c, u in claims])
        return self.stub.NodeUnprepareResources(req, timeout=30)

    def close(self) -> None:
        for watch in self.watches:
            watch.close()
        for ch in self.channels:
            ch.close()


@pytest.fixture(autouse=True)
def no_host_nvidia_specs(monkeypatch, tmp_path_factory) -> None:
    """NVIDIA's CDI specs are read from /etc/cdi and /var/run/cdi (mpsd/dra/nvidiacdi.py): here from
    empty directories of the test's own, so that a node's specs (scripts/cluster.sh writes one) do
    not change what a claim's container gets. Tests of those specs pass their directories."""
    from mpsd.dra import service

    empty = tmp_path_factory.mktemp("no-nvidia-cdi")
    monkeypatch.setattr(service, "DEFAULT_CDI_DIRS", (str(empty / "etc"), str(empty / "run")))
