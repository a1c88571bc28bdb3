"""Each Allocate hands its container a directory that no earlier pod wrote: the same slices
given to a new pod (GetPreferredAllocation makes that likely) never get the previous tenant's
files, a poisoned region lock included. Old directories are removed by garbage collection."""

from __future__ import annotations

import os
import stat
import time

from tests.plugin.conftest import RESOURCE, FakePodResources, allocate, gpus, stub


def region_dir_of(reply) -> str:
    return {m.container_path: m.host_path for m in reply.container_responses[0].mounts}["/run/mpsd"]


def test_the_same_slices_again_get_a_fresh_directory_and_the_old_one_is_collected(env, kubelet):
    pr = FakePodResources(str(env.pod_resources_socket))
    g = gpus(80)
    plugin = env.plugin(g, usage_reader=lambda path: {}, gc_grace=30.0)
    plugin.start()
    try:
        _, s = stub(plugin)
        ids = [f"{g[0].uuid}::0", f"{g[0].uuid}::1"]
        first = region_dir_of(allocate(s, ids))
        with open(os.path.join(first, "region"), "wb") as f:  # the first pod's files, a poisoned lock say
            f.write(b"\xff" * 4096)
        os.mkdir(os.path.join(first, "junk"))
        pr.pods = [("old", "ns", "c", RESOURCE, ids)]
        plugin.tracker.tick()
        pr.pods = []  # the first pod ends; the kubelet hands the same slices to the next pod at once
        second = region_dir_of(allocate(s, ids))
        assert second != first
        assert os.listdir(second) == []  # nothing of the previous tenant
        assert os.path.dirname(second) == env.paths.region_dir
        assert stat.S_IMODE(os.stat(second).st_mode) == 0o777
        (a,) = plugin.store.all()
        assert a.region_dir == second
        pr.pods = [("new", "ns", "c", RESOURCE, ids)]
        now = time.time()
        plugin.tracker.tick(now=now)
        assert os.path.isdir(first)  # not before the grace period: the old pod may still be stopping
        plugin.tracker.tick(now=now + 31)
        assert not os.path.exists(first) and os.path.isdir(second)
        assert [x.pod for x in plugin.store.all()] == ["new"]
    finally:
        plugin.stop()
        pr.stop()
    again = env.plugin(g)  # a restarted plugin knows the new directory
    again.start()
    try:
        (a,) = again.store.all()
        assert a.region_dir == second and os.path.isdir(second)
    finally:
        again.stop()


def test_every_allocate_of_a_repeated_request_is_fresh(started, env):
    g = gpus(80)
    _, s = stub(started(g))
    dirs = [region_dir_of(allocate(s, [f"{g[0].uuid}::3"])) for _ in range(5)]
    assert len(set(dirs)) == 5


def test_sweep_keeps_what_a_container_may_use_and_removes_orphans(env, kubelet):
    from mpsd.alloc.slicing import allocation_id

    pr = FakePodResources(str(env.pod_resources_socket))
    g = gpus(80)
    plugin = env.plugin(g, usage_reader=lambda path: {}, gc_grace=30.0)
    plugin.start()
    try:
        _, s = stub(plugin)
        ids = [f"{g[0].uuid}::0"]
        held = region_dir_of(allocate(s, ids))
        plugin.store.remove([allocation_id(ids)])  # the state lost it (a damaged file moved aside)
        orphan = os.path.join(env.paths.region_dir, allocation_id([f"{g[0].uuid}::5"]) + "-00112233aabb")
        os.mkdir(orphan)  # left by a crash between mkdir and the state write
        foreign = os.path.join(env.paths.region_dir, "lost+found")
        os.mkdir(foreign)
        pr.pods = [("p", "ns", "c", RESOURCE, ids)]
        now = time.time()
        plugin.tracker.tick(now=now)
        plugin.tracker.tick(now=now + 31)
        assert os.path.isdir(held)  # its devices are held by a container: kept
        assert not os.path.exists(orphan)  # nobody holds its devices: removed after the grace period
        assert os.path.isdir(foreign)  # not a name of ours
    finally:
        plugin.stop()
        pr.stop()


def test_state_file_inside_the_region_dir_is_refused(env, kubelet):
    import pytest

    from mpsd.errors import PluginError

    env.state_path = env.root / "regions" / "state.json"
    plugin = env.plugin(gpus(80))
    with pytest.raises(PluginError, match=r"state file .*state\.json is inside regionDir .*: expected a directory"):
        plugin.start()
    plugin.stop()


def test_odd_state_records_are_skipped_with_one_line_and_the_plugin_starts(env, kubelet, tmp_path, caplog):
    """Only a missing directory of ours, directly in regionDir, is re-created (0777); a record
    naming a place outside regionDir, or one where a file or a dangling link stands, is left
    alone with one line each, and the plugin starts all the same."""
    from mpsd.alloc.slicing import allocation_id
    from mpsd.alloc.state import Allocation, StateStore

    g = gpus(80)
    regions = env.paths.region_dir
    os.makedirs(regions)
    host = tmp_path / "host"
    host.mkdir()
    odd = {
        "outside": str(host / "made-by-the-plugin"),
        "file": os.path.join(regions, allocation_id([f"{g[0].uuid}::1"]) + "-000000000001"),
        "dangling": os.path.join(regions, allocation_id([f"{g[0].uuid}::2"]) + "-000000000002"),
        "nested": os.path.join(regions, "elsewhere", allocation_id([f"{g[0].uuid}::3"]) + "-000000000003"),
    }
    with open(odd["file"], "w") as f:
        f.write("not a directory")
    os.symlink(str(host / "missing"), odd["dangling"])
    good = os.path.join(regions, allocation_id([f"{g[0].uuid}::0"]) + "-000000000000")
    records = [(0, good)] + [(k, path) for k, path in enumerate(odd.values(), start=1)]
    store = StateStore(str(env.state_path))
    store.put_many(
        Allocation(allocation_id([f"{g[0].uuid}::{k}"]), (f"{g[0].uuid}::{k}",), (g[0].uuid,), {0: 1 << 30}, 10.0,
                   path, time.time())
        for k, path in records
    )
    store.close()
    plugin = env.plugin(g)
    with caplog.at_level("WARNING"):
        plugin.start()
    try:
        assert os.path.isdir(good) and stat.S_IMODE(os.stat(good).st_mode) == 0o777
        assert not (host / "made-by-the-plugin").exists() and not (host / "missing").exists()
        assert not os.path.exists(os.path.join(regions, "elsewhere"))
        assert os.path.isfile(odd["file"]) and os.path.islink(odd["dangling"])
        for path in odd.values():
            lines = [r.getMessage() for r in caplog.records if path in r.getMessage()]
            assert len(lines) == 1 and "not re-created" in lines[0], (path, lines)
        assert len(plugin.store.all()) == 5  # the records stay: garbage collection handles them
    finally:
        plugin.stop()
