"""Fixtures for the DRA kubelet plugin: fake GPUs, ResourceClaims as the API server returns them,
a Preparer over temporary directories, and a stand-in kubelet that registers the plugin through
its registration socket and calls the DRA service over real gRPC on unix sockets (paths in a
short temporary directory: unix socket paths are limited to 107 bytes)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from mpsd.dra import (
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
from mpsd.plugin.response import HostPaths
from mpsd.plugin.state import StateStore

from ..inventory.conftest import fake_nvml_lib, nvml_config  # noqa: F401 (fixtures: the fake NVML)
from ..plugin.conftest import GIB, gpus  # noqa: F401  (the same fake GPUs as the device plugin's tests)
from .apiserver import apiserver, kubeconfig  # noqa: F401 (fixtures: the stand-in API server and a KUBECONFIG for it)
from .apiserver import validate

DRIVER = "gpu.mpsd.io"
NODE = "node-a"
KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # what a 1.34 kubelet knows


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

    def plugin(self, **kw) -> DraPlugin:
        return DraPlugin(self.preparer(**kw), plugins_dir=str(self.plugins_dir), registry_dir=str(self.registry_dir),
                         poll_interval=0.05)


@pytest.fixture
def env() -> Iterator[Env]:
    root = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))
    (root / "dev").mkdir()
    paths = HostPaths(pipe_dir=str(root / "pipe"), region_dir=str(root / "regions"), shim_host_dir=str(root / "lib"))
    yield Env(root, paths, root / "cdi", root / "state" / "dra-state.json", root / "plugins", root / "registry")
    shutil.rmtree(root, ignore_errors=True)


class StandInKubelet:
    """What the kubelet's plugin watcher and DRA manager do with a DRA plugin, over gRPC: GetInfo
    on the registration socket, check the answer as the kubelet does (type, name, an absolute
    endpoint, a service it knows: the first of the plugin's list), NotifyRegistrationStatus, then
    NodePrepareResources / NodeUnprepareResources on the endpoint."""

    def __init__(self, registration_socket: str, services=KUBELET_SERVICES) -> None:
        self.registration_socket = registration_socket
        self.services = services
        self.channels: list[grpc.Channel] = []
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
        for ch in self.channels:
            ch.close()
