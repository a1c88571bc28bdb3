"""Static SM partitions for the slices of chosen MIG profiles: refused at start with the real 535
binary (no static partitioning in it: detected from the binary), and, with a stand-in daemon that
has ``-S`` (tests/fakes/mps_control_static.py, behind the real 535 front-end), each slice gets its
own partition of the instance's chunks instead of a thread percentage; released with the slice,
made again on a new daemon, refused in one line when the instance has too few chunks left."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time

import grpc
import psutil
import pytest

from mpsd.errors import SetupError
from mpsd.lifecycle.health import HealthBoard
from mpsd.mig.fleet import MigFleet
from mpsd.plugin import api_pb2
from mpsd.daemon.smpartition import binary_support, chunks_for, parse_created
from tests.fakes import install_static_partition_standin
from tests.mig.conftest import mig
from tests.mig.test_device_plugin import Node

pytestmark = pytest.mark.mps_binary
BIG = mig(3, "3g.40gb", gi=1, memory=40192 * (1 << 20), sms=60, slices=3)  # 60 SMs: 7 chunks of 8 (Hopper)


def wait_until(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_debian_binaries_have_no_static_partitioning_and_mpsd_refuses_it(mig_config, mps_control):
    supported, why = binary_support(str(mps_control))
    assert not supported and "sm_partition" in why
    with pytest.raises(SetupError) as exc:
        MigFleet(mig_config(**{"mig-sm-partition-profiles": "3g.40gb"}), HealthBoard())
    line = str(exc.value)
    assert "mig.smPartitionProfiles 3g.40gb: static SM partitions need a control binary that has them" in line
    assert "CUDA 13.1" in line and "\n" not in line
    MigFleet(mig_config(), HealthBoard())  # without the setting nothing is asked of the binary


@pytest.mark.parametrize("percent, sms, cc, chunks", [
    (25, 60, (9, 0), 1), (50, 60, (9, 0), 3), (100, 60, (9, 0), 7), (10, 16, (9, 0), 1), (50, 14, (8, 0), 1),
    (100, 14, (8, 0), 3),
])
def test_chunks_for(percent, sms, cc, chunks):
    assert chunks_for(percent, sms, cc) == chunks


def test_partition_ids_are_read_from_either_form():
    assert parse_created("Partition MIG-ab-cd/Dx4AAAA created\n") == "MIG-ab-cd/Dx4AAAA"
    assert parse_created("GPU-74d43ed3-cdf7/Dx4AAAAAAA\n") == "GPU-74d43ed3-cdf7/Dx4AAAAAAA"
    assert parse_created("Failed to fulfill the requested SM partition of 9 chunks, error X") is None


@pytest.fixture
def static_node(mig_config, mps_control, short_dir, monkeypatch):
    standin = install_static_partition_standin(short_dir / "bin", mps_control)
    monkeypatch.setenv("STANDIN_CHUNKS", f"{BIG.uuid}=7")
    made = []

    def make(**overrides) -> Node:
        overrides = {"control-binary": str(standin), "kubelet-dir": str(short_dir / "kubelet"),
                     "region-dir": str(short_dir / "regions"), "shim-host-dir": str(short_dir / "lib"),
                     "pod-resources-socket": str(short_dir / "none.sock"), "slices-per-gpu": "4",
                     "mig-sm-partition-profiles": "3g.40gb", **overrides}
        node = Node(mig_config(**overrides), short_dir)
        made.append(node)
        return node

    yield make
    for node in made:
        node.close()


def lspart(fleet: MigFleet, uuid: str) -> str:
    return fleet.control(uuid).call("lspart")


def allocate(stub, *ids: str):
    return stub.Allocate(api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=list(ids))]), timeout=15)


def test_slices_of_a_static_profile_get_partitions_not_thread_caps(static_node):
    n = static_node()
    n.fleet.reconcile([BIG])
    wait_until(lambda: BIG.uuid in n.fleet.board.current().mig_healthy, what="healthy")
    daemon = psutil.Process(n.fleet.daemon_pid(BIG.uuid))
    assert "-S" in daemon.cmdline() and n.fleet.device(BIG.uuid).sm_partitions
    n.thread.start()
    wait_until(lambda: "3g.40gb" in n.plugins.plugins, what="plugin")
    stub = n.stub("3g.40gb")
    env = dict(allocate(stub, f"{BIG.uuid}::0", f"{BIG.uuid}::1").container_responses[0].envs)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    part = env["CUDA_MPS_SM_PARTITION"]
    assert part.startswith(BIG.uuid + "/") and f"{part} {BIG.uuid} 3 chunks" in lspart(n.fleet, BIG.uuid)  # 50 %
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == n.fleet.pipe_dir(BIG.uuid)
    again = dict(allocate(stub, f"{BIG.uuid}::1", f"{BIG.uuid}::0").container_responses[0].envs)
    assert again["CUDA_MPS_SM_PARTITION"] == part  # the kubelet's retry: the same partition

    other = dict(allocate(stub, f"{BIG.uuid}::2", f"{BIG.uuid}::3").container_responses[0].envs)
    assert f"{BIG.uuid} free chunks 1" in lspart(n.fleet, BIG.uuid)
    plugin = n.plugins.plugins["3g.40gb"]
    key = plugin.store.all()[0].allocation_id
    plugin.backend.release(key)  # what garbage collection does once no pod holds it
    assert f"{BIG.uuid} free chunks 4" in lspart(n.fleet, BIG.uuid)
    assert other["CUDA_MPS_SM_PARTITION"] in lspart(n.fleet, BIG.uuid)


def test_too_few_free_chunks_is_refused_in_one_line(static_node):
    n = static_node(**{"slices-per-gpu": "2"})
    n.fleet.reconcile([BIG])
    n.thread.start()
    # the kubelet allocates only devices the plugin lists healthy, i.e. once the instance's daemon runs
    wait_until(lambda: BIG.uuid in n.fleet.board.current().mig_healthy, what="healthy")
    wait_until(lambda: "3g.40gb" in n.plugins.plugins, what="plugin")
    stub = n.stub("3g.40gb")
    allocate(stub, f"{BIG.uuid}::0", f"{BIG.uuid}::1")  # 100 %: all 7 chunks
    with pytest.raises(grpc.RpcError) as exc:
        allocate(stub, f"{BIG.uuid}::0")
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "made no partition" in exc.value.details() and "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION" in \
        exc.value.details()


def test_a_restarted_daemon_gets_the_partition_made_again(static_node):
    n = static_node()
    n.fleet.reconcile([BIG])
    wait_until(lambda: BIG.uuid in n.fleet.board.current().mig_healthy, what="healthy")
    n.thread.start()
    wait_until(lambda: "3g.40gb" in n.plugins.plugins, what="plugin")
    stub = n.stub("3g.40gb")
    first = dict(allocate(stub, f"{BIG.uuid}::0").container_responses[0].envs)["CUDA_MPS_SM_PARTITION"]
    old = n.fleet.daemon_pid(BIG.uuid)
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: n.fleet.daemon_pid(BIG.uuid) not in (None, old)
               and BIG.uuid in n.fleet.board.current().mig_healthy, what="restarted")
    second = dict(allocate(stub, f"{BIG.uuid}::0").container_responses[0].envs)["CUDA_MPS_SM_PARTITION"]
    assert second != first and second in lspart(n.fleet, BIG.uuid)


def test_dra_publishes_which_instances_partition():
    from mpsd.dra.migdevices import build

    static = dataclasses.replace(BIG, slices=4, sm_partitions=True)
    (device,) = build([static], "capacity")
    assert device["attributes"]["smPartitions"] == {"bool": True}
    (plain,) = build([dataclasses.replace(BIG, slices=4)], "capacity")
    assert plain["attributes"]["smPartitions"] == {"bool": False}


def test_the_standin_front_end_is_the_real_binary(mps_control, short_dir):
    standin = install_static_partition_standin(short_dir / "bin2", mps_control)
    out = subprocess.run([str(standin)], input="get_server_list\n", capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(short_dir / "nowhere")))
    assert out.returncode == 1 and "Cannot find MPS control daemon process" in out.stdout + out.stderr
