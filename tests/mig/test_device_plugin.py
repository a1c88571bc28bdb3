"""The device plugin's MIG face end to end over real gRPC: one resource per profile registered with a
stand-in kubelet, slices of each instance listed with each instance's own health, Allocate giving the
instance's pipe dir and limits, a request across instances refused, the layout followed, and an
instance the configuration cannot divide left out in one line. Each instance has its real daemon."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from mpsd.errors import PluginError
from mpsd.inventory.mig import MIB
from mpsd.mig.fleet import MigFleet
from mpsd.mig.plugin import MigPlugins, resource_name
from mpsd.lifecycle.health import HealthBoard
from mpsd.plugin import api_pb2, api_pb2_grpc
from mpsd.alloc.slicing import slice_share_bytes
from tests.mig.conftest import mig
from tests.plugin.conftest import FakeKubelet

pytestmark = pytest.mark.mps_binary


def wait_until(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Node:
    """A fleet of instance daemons and the MIG plugins on one stand-in kubelet."""

    def __init__(self, config, short_dir):
        (short_dir / "kubelet").mkdir(exist_ok=True)
        self.kubelet = FakeKubelet(str(short_dir / "kubelet" / "kubelet.sock"))
        self.fleet = MigFleet(config, HealthBoard())
        self.plugins = MigPlugins(config, self.fleet, self.fleet.board, usage_interval=0)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.plugins.run, args=(self.stop, 0.05), daemon=True)

    def stub(self, profile: str):
        plugin = self.plugins.plugins[profile]
        channel = grpc.insecure_channel("unix://" + plugin.socket_path)
        return api_pb2_grpc.DevicePluginStub(channel)

    def close(self):
        self.stop.set()
        if self.thread.ident is not None:  # a test may call plugins.run itself
            self.thread.join(15)
        self.fleet.stop()
        self.kubelet.stop()


@pytest.fixture
def node(mig_config, short_dir):
    made = []

    def make(**overrides) -> Node:
        overrides = {"kubelet-dir": str(short_dir / "kubelet"), "region-dir": str(short_dir / "regions"),
                     "shim-host-dir": str(short_dir / "lib"), "pod-resources-socket": str(short_dir / "none.sock"), "slices-per-gpu": "4",
                     **overrides}
        n = Node(mig_config(**overrides), short_dir)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def first_list(stub) -> dict[str, str]:
    stream = stub.ListAndWatch(api_pb2.Empty(), timeout=10)
    response = next(stream)
    stream.cancel()
    return {d.ID: d.health for d in response.devices}


def test_one_resource_per_profile_with_the_instances_slices_and_their_health(node):
    n = node()
    a, b, c = mig(1), mig(2), mig(3, "3g.40gb", gi=1, memory=40192 * MIB, sms=60, slices=3)
    n.fleet.reconcile([a, b, c])
    wait_until(lambda: n.fleet.board.current().mig_healthy == {a.uuid, b.uuid, c.uuid}, what="healthy")
    n.thread.start()
    wait_until(lambda: len(n.kubelet.requests) == 2, what="both profiles registered")
    assert sorted(r.resource_name for r in n.kubelet.requests) == ["mpsd.io/mig-1g.10gb", "mpsd.io/mig-3g.40gb"]
    # auto: slicesPerGpu 4, fewer where the instance cannot hold them (1g: 48 x 1/7 = 6 clients, 16 SMs: 8)
    assert first_list(n.stub("1g.10gb")) == {f"{u}::{k}": "Healthy" for u in (a.uuid, b.uuid) for k in range(4)}
    assert first_list(n.stub("3g.40gb")) == {f"{c.uuid}::{k}": "Healthy" for k in range(4)}


def test_allocate_gives_the_instances_pipe_dir_and_its_share(node):
    n = node()
    a, b = mig(1), mig(2)
    n.fleet.reconcile([a, b])
    n.thread.start()
    wait_until(lambda: "1g.10gb" in n.plugins.plugins, what="plugin")
    stub = n.stub("1g.10gb")
    reply = stub.Allocate(api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=[f"{a.uuid}::0", f"{a.uuid}::1"])]), timeout=10)
    env = dict(reply.container_responses[0].envs)
    pipe_dir = n.fleet.pipe_dir(a.uuid)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe_dir
    assert env["NVIDIA_VISIBLE_DEVICES"] == a.uuid
    mib = (slice_share_bytes(a.memory_total, 4, 0) + slice_share_bytes(a.memory_total, 4, 1)) // MIB
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={mib}M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    mounts = {m.container_path: (m.host_path, m.read_only) for m in reply.container_responses[0].mounts}
    assert mounts[pipe_dir] == (pipe_dir, True)
    assert n.fleet.pipe_dir(b.uuid) != pipe_dir

    with pytest.raises(grpc.RpcError) as exc:  # one client reaches one daemon
        stub.Allocate(api_pb2.AllocateRequest(container_requests=[
            api_pb2.ContainerAllocateRequest(devices_ids=[f"{a.uuid}::2", f"{b.uuid}::2"])]), timeout=10)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "more than one MPS daemon" in exc.value.details()


def test_a_layout_change_reaches_the_kubelet_and_a_vanished_instance_is_refused(node):
    n = node()
    a, b = mig(1), mig(2)
    n.fleet.reconcile([a, b])
    wait_until(lambda: n.fleet.board.current().mig_healthy == {a.uuid, b.uuid}, what="healthy")
    n.thread.start()
    wait_until(lambda: "1g.10gb" in n.plugins.plugins, what="plugin")
    stub = n.stub("1g.10gb")
    stream = stub.ListAndWatch(api_pb2.Empty(), timeout=30)
    assert {d.ID.split("::")[0] for d in next(stream).devices} == {a.uuid, b.uuid}
    n.fleet.reconcile([a])  # the MIG manager destroyed b
    for response in stream:
        if {d.ID.split("::")[0] for d in response.devices} == {a.uuid}:
            break
    stream.cancel()
    with pytest.raises(grpc.RpcError) as exc:  # the kubelet still had b's slice when it asked
        stub.Allocate(api_pb2.AllocateRequest(container_requests=[
            api_pb2.ContainerAllocateRequest(devices_ids=[f"{b.uuid}::0"])]), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and b.uuid in exc.value.details()


def test_an_instance_the_config_cannot_divide_is_not_offered(node, caplog):
    n = node(**{"mig-slices-per-instance": "10"})
    small, big = mig(1), mig(3, "3g.40gb", gi=1, memory=40192 * MIB, sms=60, slices=3)
    n.fleet.reconcile([small, big])
    n.thread.start()
    wait_until(lambda: "3g.40gb" in n.plugins.plugins, what="3g plugin")
    time.sleep(0.3)  # a few sync rounds
    assert "1g.10gb" not in n.plugins.plugins
    assert [r.resource_name for r in n.kubelet.requests] == ["mpsd.io/mig-3g.40gb"]
    assert len(first_list(n.stub("3g.40gb"))) == 10
    lines = [r.getMessage() for r in caplog.records if "cannot be divided into 10 slices" in r.getMessage()]
    assert len(lines) == 1, lines  # said once, not every round
    assert "its compute instance takes 6 MPS clients (48 x 1/7); expected mig.slicesPerInstance at most 6" in lines[0]
    assert n.fleet.get(small.uuid) is not None  # its daemon runs all the same


def test_a_burst_memory_limit_is_refused_in_one_line_and_nothing_is_offered(node):
    """devicePlugin.memoryLimit asks for burst, which an instance's daemon (MPS v2) cannot lend: the MIG
    plugins refuse at start, as the whole-GPU plugin does on MPS v2, rather than serve without it."""
    n = node(**{"memory-limit": "50%"})
    n.fleet.reconcile([mig(1)])
    bound = threading.Timer(10, n.stop.set)  # without the refusal run() serves until stopped
    bound.start()
    try:
        with pytest.raises(PluginError) as exc:
            n.plugins.run(n.stop, 0.05)
    finally:
        bound.cancel()
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("devicePlugin.memoryLimit 50% cannot be enforced on MIG instances: "), message
    assert "capped at their guarantee" in message
    assert n.plugins.plugins == {} and n.kubelet.requests == []


def test_resource_names():
    assert resource_name("mpsd.io/gpu", "1g.10gb") == "mpsd.io/mig-1g.10gb"
    assert resource_name("example.com/shared-gpu", "1c.3g.40gb") == "example.com/mig-1c.3g.40gb"
    # as NVIDIA's mixed strategy: + becomes . (nvidia.com/mig-1g.10gb.me); go-nvlib's negative -me
    # ("without media extensions") keeps its dash, so the two are two resources, not one read backwards
    assert resource_name("mpsd.io/gpu", "1g.10gb+me") == "mpsd.io/mig-1g.10gb.me"
    assert resource_name("mpsd.io/gpu", "1g.10gb+me.all") == "mpsd.io/mig-1g.10gb.me.all"
    assert resource_name("mpsd.io/gpu", "1g.10gb-me") == "mpsd.io/mig-1g.10gb-me"
