"""Fixtures for the device plugin: GPU fakes, a fake kubelet (Registration server), a fake
pod-resources server, a kubelet-like gRPC client and a started DevicePlugin, all on unix
sockets in a short temporary directory (unix socket paths are limited to 107 bytes)."""

from __future__ import annotations

import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest

from mpsd.lifecycle.health import HealthBoard
from mpsd.plugin import DevicePlugin, api_pb2, api_pb2_grpc, podresources_pb2, podresources_pb2_grpc
from mpsd.alloc.container import HostPaths
from mpsd.trees import remove_tree

GIB = 1 << 30
RESOURCE = "mpsd.io/gpu"


@dataclass(frozen=True)
class FakeGpu:
    index: int
    uuid: str
    name: str
    memory_total: int


def gpus(*sizes_gib: int) -> list[FakeGpu]:
    return [FakeGpu(i, f"GPU-{i:08d}-aaaa-bbbb-cccc-{i:012d}", "Fake H100", s * GIB) for i, s in enumerate(sizes_gib)]


class FakeKubelet(api_pb2_grpc.RegistrationServicer):
    """Registration served on <dir>/kubelet.sock; records every RegisterRequest."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.requests: list[api_pb2.RegisterRequest] = []
        self.registered = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port("unix://" + socket_path)
        self.server.start()

    def Register(self, request, context):
        self.requests.append(request)
        self.registered.set()
        return api_pb2.Empty()

    def stop(self) -> None:
        self.server.stop(grace=0).wait()
        Path(self.socket_path).unlink(missing_ok=True)


class FakePodResources(podresources_pb2_grpc.PodResourcesListerServicer):
    """PodResourcesLister.List answering with ``pods``: [(pod, namespace, container, resource, ids)]."""

    def __init__(self, socket_path: str) -> None:
        self.pods: list[tuple[str, str, str, str, list[str]]] = []
        self.calls = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(self, self.server)
        self.server.add_insecure_port("unix://" + socket_path)
        self.server.start()

    def List(self, request, context):
        self.calls += 1
        reply = podresources_pb2.ListPodResourcesResponse()
        for pod, namespace, container, resource, ids in self.pods:
            p = reply.pod_resources.add(name=pod, namespace=namespace)
            c = p.containers.add(name=container)
            c.devices.add(resource_name=resource, device_ids=ids)
        return reply

    def stop(self) -> None:
        self.server.stop(grace=0).wait()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))
    yield d
    remove_tree(str(d))  # what a test's pods left, of any depth


@dataclass
class Env:
    root: Path
    kubelet_dir: Path
    board: HealthBoard
    paths: HostPaths
    state_path: Path
    pod_resources_socket: Path

    def plugin(self, gpu_list, slices: int = 10, **kw) -> DevicePlugin:
        kw.setdefault("poll_interval", 0.05)
        kw.setdefault("wake_interval", 0.05)
        kw.setdefault("usage_interval", 0)  # tests drive tracker.tick themselves
        return DevicePlugin(
            gpus=gpu_list,
            resource_name=RESOURCE,
            slices_per_gpu=slices,
            kubelet_dir=str(self.kubelet_dir),
            paths=self.paths,
            state_path=str(self.state_path),
            board=self.board,
            pod_resources_socket=str(self.pod_resources_socket),
            **kw,
        )


@pytest.fixture
def env(short_dir: Path) -> Env:
    kubelet_dir = short_dir / "dp"
    kubelet_dir.mkdir()
    paths = HostPaths(
        pipe_dir=str(short_dir / "pipe"),
        region_dir=str(short_dir / "regions"),
        shim_host_dir=str(short_dir / "lib"),
    )
    return Env(short_dir, kubelet_dir, HealthBoard(), paths, short_dir / "state" / "plugin.json", short_dir / "pr.sock")


@pytest.fixture
def kubelet(env: Env) -> Iterator[FakeKubelet]:
    k = FakeKubelet(str(env.kubelet_dir / "kubelet.sock"))
    yield k
    k.stop()


@pytest.fixture
def started(env: Env, kubelet: FakeKubelet) -> Iterator[Callable[..., DevicePlugin]]:
    """Start plugins (stopped at teardown)."""
    plugins: list[DevicePlugin] = []

    def start(gpu_list, slices: int = 10, **kw) -> DevicePlugin:
        p = env.plugin(gpu_list, slices, **kw)
        p.start()
        plugins.append(p)
        return p

    yield start
    for p in plugins:
        p.stop()


def stub(plugin: DevicePlugin | str) -> tuple[grpc.Channel, api_pb2_grpc.DevicePluginStub]:
    """A kubelet-like client of a plugin (or of a plugin socket path)."""
    path = plugin if isinstance(plugin, str) else plugin.socket_path
    channel = grpc.insecure_channel("unix://" + path, options=[("grpc.enable_http_proxy", 0)])
    return channel, api_pb2_grpc.DevicePluginStub(channel)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def allocate(s: api_pb2_grpc.DevicePluginStub, *containers: list[str]) -> api_pb2.AllocateResponse:
    """Allocate as the kubelet calls it: one ContainerAllocateRequest per list of device IDs."""
    req = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=c) for c in containers])
    return s.Allocate(req, timeout=10)
