"""A rolling update of the device plugin with maxSurge: the old and the new mpsd register the same
resource from sockets of their own; the stand-in device manager (tests/plugin/devicemanager.py,
as the kubelet's) moves Allocate to the new one, marks the resource unhealthy when the old one's
stream ends, and the new one registers again at once: the node's slices come back healthy,
Allocate keeps working and every allocation survives."""

from __future__ import annotations

import os
import time

import pytest

from mpsd.plugin import socket_name_for
from mpsd.alloc.state import StateStore

from tests.plugin.conftest import RESOURCE, gpus, wait_for
from tests.plugin.devicemanager import StandInDeviceManager

OLD, NEW = "0b5d9a62-1f2e-4c3d-8e9f-0a1b2c3d4e5f", "7c1e2d3f-4a5b-4c6d-9e8f-1a2b3c4d5e6f"


@pytest.fixture
def manager(env):
    m = StandInDeviceManager(env.kubelet_dir)
    env.board.update(daemon_up=True, configured=True)
    yield m
    m.stop()


@pytest.fixture
def plugins(env):
    started = []

    def start(instance: str, **kw):
        p = env.plugin(gpus(80), 4, instance=instance, **kw)
        p.start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def healthy(manager) -> list[str]:
    with manager.lock:
        return sorted(manager.healthy.get(RESOURCE, set()))


def test_old_and_new_overlap_and_the_resource_stays_usable(env, manager, plugins):
    old = plugins(OLD)
    assert old.socket_name == f"mpsd-mpsd.io_gpu-{OLD}.sock"
    assert wait_for(lambda: len(healthy(manager)) == 4)
    ids = healthy(manager)
    first = manager.allocate(RESOURCE, [ids[0]])

    new = plugins(NEW)  # maxSurge: the new pod starts while the old one serves
    assert wait_for(lambda: manager.registrations == [socket_name_for(RESOURCE, i) for i in (OLD, NEW)])
    assert os.path.exists(old.socket_path) and os.path.exists(new.socket_path)  # side by side
    second = manager.allocate(RESOURCE, [ids[1]])  # the new one serves it

    old.stop()  # the kubelet marks the resource unhealthy when the old stream ends ...
    assert wait_for(lambda: len(manager.registrations) == 3)  # ... and the new one registers again
    assert manager.registrations[-1] == new.socket_name
    assert wait_for(lambda: healthy(manager) == ids)
    third = manager.allocate(RESOURCE, [ids[2]])

    stored = {a.device_ids for a in StateStore(str(env.state_path)).load().values()}
    assert stored == {(ids[0],), (ids[1],), (ids[2],)}  # every allocation survives, on disk
    assert {a.device_ids for a in new.store.all()} == stored  # and in the new instance
    for response in (first, second, third):
        (container,) = response.container_responses
        assert container.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]


def test_the_old_stream_ends_before_its_socket_goes_so_the_new_registration_is_the_last_word(env, manager, plugins):
    """The new instance registers again when the old one's socket goes; the kubelet marks the
    resource unhealthy when the old one's stream ends. The stream used to end up to a
    wake_interval after the socket went (gRPC unlinks it as the server stops), so the kubelet's
    verdict came after the new registration and the node's slices stayed unhealthy for good."""
    old = plugins(OLD, wake_interval=0.5)  # the production default: streams see a stop that late
    assert wait_for(lambda: len(healthy(manager)) == 4)
    ids = healthy(manager)
    new = plugins(NEW)
    assert wait_for(lambda: manager.registrations == [socket_name_for(RESOURCE, i) for i in (OLD, NEW)])
    ended: list[bool] = []
    disconnected = manager.disconnected

    def record(client) -> None:
        if client.socket == old.socket_path:
            ended.append(os.path.exists(client.socket))
        disconnected(client)

    manager.disconnected = record
    old.stop()
    assert wait_for(lambda: ended) and ended == [True]  # its socket was still there when its stream ended
    assert wait_for(lambda: manager.registrations[-1:] == [new.socket_name] and len(manager.registrations) == 3)
    assert wait_for(lambda: healthy(manager) == ids)
    time.sleep(1.0)
    assert healthy(manager) == ids


def test_without_instances_a_second_plugin_takes_over_the_socket_of_the_first(env, manager, plugins):
    """The fixed name (no POD_UID: one instance at a time) is what a restart without overlap uses."""
    first = plugins("")
    second = plugins("")
    assert first.socket_path == second.socket_path == str(env.kubelet_dir / "mpsd-mpsd.io_gpu.sock")


def test_a_socket_left_by_a_killed_instance_is_removed_at_start(env, manager, plugins):
    import socket

    stale = env.kubelet_dir / socket_name_for(RESOURCE, "killed-pod")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()
    other = env.kubelet_dir / "nvidia-gpu.sock"  # another plugin's: not ours to judge
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(other))
    s.close()
    plugins(NEW)
    assert not stale.exists() and other.exists()
