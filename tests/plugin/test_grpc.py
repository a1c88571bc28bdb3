"""The plugin as the kubelet sees it: real gRPC over unix sockets in a temporary directory."""

from __future__ import annotations

import os
import queue
import stat
import threading

import grpc
import pytest

from mpsd.plugin import api_pb2
from mpsd.units import parse_limits

from tests.plugin.conftest import GIB, RESOURCE, FakeKubelet, allocate, gpus, stub, wait_for

EMPTY = api_pb2.Empty()


def prefer(s, available, size, must=()):
    req = api_pb2.PreferredAllocationRequest(
        container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=list(must), allocation_size=size
            )
        ]
    )
    return list(s.GetPreferredAllocation(req, timeout=10).container_responses[0].deviceIDs)


class Stream:
    """A ListAndWatch stream read on a thread, as the kubelet reads it."""

    def __init__(self, s) -> None:
        self.call = s.ListAndWatch(EMPTY)
        self.updates: queue.Queue = queue.Queue()
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.updates.put({d.ID: d.health for d in reply.devices})
        except grpc.RpcError as exc:
            self.updates.put(exc)
        finally:
            self.ended.set()

    def next(self, timeout: float = 10.0) -> dict[str, str]:
        update = self.updates.get(timeout=timeout)
        assert isinstance(update, dict), update
        return update


def test_registers_with_the_kubelet(started, kubelet: FakeKubelet):
    plugin = started(gpus(80))
    assert kubelet.registered.wait(5)
    (req,) = kubelet.requests
    assert req.version == "v1beta1"
    assert req.resource_name == RESOURCE
    assert req.endpoint == os.path.basename(plugin.socket_path)
    assert os.path.dirname(plugin.socket_path) == os.path.dirname(kubelet.socket_path)
    assert stat.S_ISSOCK(os.stat(plugin.socket_path).st_mode)
    assert req.options.get_preferred_allocation_available and not req.options.pre_start_required


def test_options_and_prestart(started):
    _, s = stub(started(gpus(80)))
    opts = s.GetDevicePluginOptions(EMPTY, timeout=5)
    assert opts.get_preferred_allocation_available and not opts.pre_start_required
    reply = s.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["x"]), timeout=5)
    assert reply == api_pb2.PreStartContainerResponse()


def test_list_and_watch_follows_the_daemon_health(started, env):
    g = gpus(80, 40)
    plugin = started(g, slices=4)
    _, s = stub(plugin)
    stream = Stream(s)
    first = stream.next()
    assert sorted(first) == sorted(f"{x.uuid}::{k}" for x in g for k in range(4))
    assert set(first.values()) == {"Unhealthy"}  # the daemon is not up yet
    env.board.update(daemon_up=True, configured=True)
    assert set(stream.next().values()) == {"Healthy"}
    env.board.update(faulted_gpus={1})
    faulted = stream.next()
    assert {d for d, h in faulted.items() if h == "Unhealthy"} == {f"{g[1].uuid}::{k}" for k in range(4)}
    env.board.update(faulted_gpus=set())
    assert set(stream.next().values()) == {"Healthy"}
    env.board.update(daemon_up=False)  # the daemon dies
    assert set(stream.next().values()) == {"Unhealthy"}
    env.board.update(daemon_up=True)  # restarted by the supervisor
    assert set(stream.next().values()) == {"Healthy"}
    env.board.update(last_error="noise")  # no health change: nothing sent
    with pytest.raises(queue.Empty):
        stream.updates.get(timeout=0.3)
    plugin.stop()
    assert stream.ended.wait(5)  # the stream ends when the plugin stops, without an error
    assert stream.updates.empty()
    assert stream.call.code() == grpc.StatusCode.OK


def test_uneven_requests_on_one_gpu(started, env):
    g = gpus(80)
    plugin = started(g, slices=10)
    _, s = stub(plugin)
    every = [f"{g[0].uuid}::{k}" for k in range(10)]

    first = prefer(s, every, 3)
    assert first == every[:3]
    r1 = allocate(s, first).container_responses[0]
    rest = [d for d in every if d not in first]
    second = prefer(s, rest, 7)
    assert sorted(second) == sorted(rest)
    r2 = allocate(s, second).container_responses[0]

    assert parse_limits(r1.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == {0: 24 * GIB}
    assert r1.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert parse_limits(r2.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == {0: 56 * GIB}
    assert r2.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
    for r in (r1, r2):
        assert r.envs["NVIDIA_VISIBLE_DEVICES"] == g[0].uuid
        assert r.envs["CUDA_MPS_PIPE_DIRECTORY"] == env.paths.pipe_dir
        assert r.envs["LD_PRELOAD"] == "/run/mpsd-shim/libmpsshim.so.3"
        assert r.envs["MPSSHIM_REGION"] == "/run/mpsd/region"
        assert r.envs["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    regions = {m.host_path for r in (r1, r2) for m in r.mounts if m.container_path == "/run/mpsd"}
    assert len(regions) == 2  # one accounting region per container
    for region in regions:
        assert os.path.dirname(region) == env.paths.region_dir
        assert stat.S_IMODE(os.stat(region).st_mode) == 0o777


def test_mounts(started, env):
    g = gpus(16)
    _, s = stub(started(g, slices=2))
    r = allocate(s, [f"{g[0].uuid}::1"]).container_responses[0]
    mounts = {m.container_path: (m.host_path, m.read_only) for m in r.mounts}
    assert mounts[env.paths.pipe_dir] == (env.paths.pipe_dir, True)  # read-only: no pod writes it
    assert mounts["/run/mpsd-shim"] == (env.paths.shim_host_dir, True)
    assert mounts["/run/mpsd"][1] is False
    assert "/dev/shm" not in mounts  # hostIPC mode


def test_tmpfs_mode_mounts_the_shared_shm(env, kubelet):
    from dataclasses import replace

    env.paths = replace(env.paths, ipc_mode="tmpfs", shm_dir=str(env.root / "shm"))
    g = gpus(16)
    plugin = env.plugin(g, slices=2)
    plugin.start()
    try:
        _, s = stub(plugin)
        r = allocate(s, [f"{g[0].uuid}::0"]).container_responses[0]
        assert {m.container_path: m.host_path for m in r.mounts}["/dev/shm"] == str(env.root / "shm")
    finally:
        plugin.stop()


def test_two_gpus_preferred_on_one_and_spanning_allocation(started, caplog):
    g = gpus(80, 40)
    _, s = stub(started(g, slices=10))
    every = [f"{x.uuid}::{k}" for x in g for k in range(10)]
    # GPU 0 has 2 free slices left, GPU 1 all 10: a request of 3 goes to GPU 1 only
    available = every[8:]
    assert prefer(s, available, 3) == [f"{g[1].uuid}::{k}" for k in range(3)]
    # the kubelet may still hand out slices on both: each GPU gets its own limit, by ordinal
    with caplog.at_level("WARNING", logger="mpsd.plugin.servicer"):
        r = allocate(s, [every[9], every[10], every[11]]).container_responses[0]
    assert r.envs["NVIDIA_VISIBLE_DEVICES"] == f"{g[0].uuid},{g[1].uuid}"
    assert parse_limits(r.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == {0: 8 * GIB, 1: 8 * GIB}
    assert r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"  # the larger of 10% and 20%
    assert "allocation spans GPUs" in caplog.text


def test_several_containers_in_one_request(started):
    g = gpus(80)
    _, s = stub(started(g, slices=10))
    reply = allocate(s, [f"{g[0].uuid}::0"], [f"{g[0].uuid}::1", f"{g[0].uuid}::2"])
    limits = [parse_limits(r.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"])[0] for r in reply.container_responses]
    assert limits == [8 * GIB, 16 * GIB]


@pytest.mark.parametrize(
    "devices, message",
    [(["GPU-nope::0"], "is not on this node"), (["garbage"], "bad device ID 'garbage'")],
)
def test_allocate_rejects_unknown_devices(started, devices, message):
    _, s = stub(started(gpus(80)))
    with pytest.raises(grpc.RpcError) as info:
        allocate(s, devices)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_preferred_allocation_rejects_bad_requests(started):
    g = gpus(80)
    _, s = stub(started(g))
    with pytest.raises(grpc.RpcError) as info:
        prefer(s, [f"{g[0].uuid}::0"], 2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "size 2 with 1 device IDs available" in info.value.details()


def test_kubelet_restart_leads_to_registration_again(started, env, kubelet):
    plugin = started(gpus(80))
    assert wait_for(lambda: len(kubelet.requests) == 1)
    kubelet.stop()  # the kubelet goes away: its socket vanishes
    # a restarting kubelet also removes the plugin sockets in its directory
    os.unlink(plugin.socket_path)
    new = FakeKubelet(kubelet.socket_path)
    try:
        assert new.registered.wait(10)
        assert wait_for(lambda: os.path.exists(plugin.socket_path))
        assert new.requests[0].endpoint == os.path.basename(plugin.socket_path)
        _, s = stub(plugin)
        assert s.GetDevicePluginOptions(EMPTY, timeout=5).get_preferred_allocation_available
        assert wait_for(lambda: plugin.registrations == 2)  # counted once Register has returned, after the kubelet saw it
    finally:
        new.stop()


def test_deleted_plugin_socket_is_recreated_and_registered_again(started, kubelet):
    plugin = started(gpus(80))
    assert wait_for(lambda: plugin.registrations == 1)
    os.unlink(plugin.socket_path)
    assert wait_for(lambda: plugin.registrations == 2)
    assert len(kubelet.requests) == 2
    _, s = stub(plugin)
    assert s.GetDevicePluginOptions(EMPTY, timeout=5).get_preferred_allocation_available


def test_waits_for_a_kubelet_that_is_not_there_yet(env):
    plugin = env.plugin(gpus(80))
    plugin.start()
    try:
        assert plugin.registrations == 0
        k = FakeKubelet(str(env.kubelet_dir / "kubelet.sock"))
        try:
            assert k.registered.wait(10)
            assert wait_for(lambda: plugin.registrations == 1)
        finally:
            k.stop()
    finally:
        plugin.stop()
    assert not os.path.exists(plugin.socket_path)  # cleaned up on stop


def test_restarted_plugin_restores_allocations_from_disk(env, kubelet):
    g = gpus(80)
    first = env.plugin(g)
    first.start()
    try:
        _, s = stub(first)
        r = allocate(s, [f"{g[0].uuid}::3", f"{g[0].uuid}::4"]).container_responses[0]
    finally:
        first.stop()
    region = {m.container_path: m.host_path for m in r.mounts}["/run/mpsd"]
    second = env.plugin(g)
    second.start()
    try:
        (a,) = second.store.all()
        assert a.device_ids == (f"{g[0].uuid}::3", f"{g[0].uuid}::4")
        assert a.memory_limits == {0: 16 * GIB}
        assert a.region_dir == region and os.path.isdir(region)
        # the same devices again (a new pod): the same allocation, recorded once, in a new
        # directory (the previous tenant's region is not handed on; GC removes it later)
        _, s = stub(second)
        again = allocate(s, [f"{g[0].uuid}::4", f"{g[0].uuid}::3"]).container_responses[0]
        fresh = {m.container_path: m.host_path for m in again.mounts}["/run/mpsd"]
        assert fresh != region and os.listdir(fresh) == []
        assert [x.region_dir for x in second.store.all()] == [fresh]
    finally:
        second.stop()


def test_shim_is_installed_atomically_at_start(env, kubelet, tmp_path):
    lib = tmp_path / "libmpsshim.so"
    lib.write_bytes(b"\x7fELF fake shim v1")
    plugin = env.plugin(gpus(80), shim_library=str(lib))
    plugin.start()
    plugin.stop()
    installed = os.path.join(env.paths.shim_host_dir, "libmpsshim.so.3")
    assert open(installed, "rb").read() == b"\x7fELF fake shim v1"
    assert os.listdir(env.paths.shim_host_dir) == ["libmpsshim.so.3"]  # no temporary left behind
    lib.write_bytes(b"\x7fELF fake shim v2")
    before = os.stat(installed).st_ino
    plugin = env.plugin(gpus(80), shim_library=str(lib))
    plugin.start()
    plugin.stop()
    assert open(installed, "rb").read() == b"\x7fELF fake shim v2"
    assert os.stat(installed).st_ino != before  # replaced by rename, not rewritten in place


def test_missing_shim_is_a_one_line_error(env):
    from mpsd.errors import PluginError

    plugin = env.plugin(gpus(80), shim_library=str(env.root / "nope.so"))
    with pytest.raises(PluginError, match=r"cannot read .*nope\.so"):
        plugin.start()


def test_concurrent_allocates_are_all_recorded(started, env):
    g = gpus(80, 80)
    plugin = started(g, slices=10)
    sets = [[f"{g[i // 10].uuid}::{i % 10}"] for i in range(20)]
    errors: list[BaseException] = []

    def one(ids: list[str]) -> None:
        try:
            _, s = stub(plugin)
            allocate(s, ids)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(ids,)) for ids in sets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert sorted(a.device_ids for a in plugin.store.all()) == sorted(tuple(ids) for ids in sets)
    from mpsd.alloc.state import StateStore

    assert len(StateStore(str(env.state_path)).load()) == 20  # every one reached the disk


def test_socket_directory_removed_and_restored(started, env, kubelet):
    import shutil

    plugin = started(gpus(80))
    assert wait_for(lambda: plugin.registrations == 1)
    kubelet.stop()
    shutil.rmtree(env.kubelet_dir)  # the whole directory goes away for a moment
    env.kubelet_dir.mkdir(exist_ok=True)  # the plugin may have re-created it already
    new = FakeKubelet(kubelet.socket_path)
    try:
        assert new.registered.wait(10)
        assert wait_for(lambda: os.path.exists(plugin.socket_path) and plugin.registrations == 2)
    finally:
        new.stop()
