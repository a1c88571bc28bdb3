"""Per-pod labels from the pod-resources API, garbage collection of stale allocations, and
per-allocation usage pushed to the real Metrics."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import grpc
import pytest

from mpsd.registry import Metrics
from mpsd.plugin import podresources_pb2_grpc
from mpsd.plugin.kubelet import Holder
from mpsd.alloc.state import Allocation
from mpsd.plugin.usage import reconcile
from mpsd.alloc.usage import shim_usage

from tests.plugin.conftest import GIB, RESOURCE, FakePodResources, allocate, gpus, stub, wait_for


def alloc(aid: str, ids: tuple[str, ...], created: float = 0.0, **labels) -> Allocation:
    return Allocation(aid, ids, ("GPU-a",), {0: GIB}, 10.0, f"/r/{aid}", created, **labels)


OLD = alloc("old", ("GPU-a::0",), created=0.0, pod="p0", namespace="n0", container="c0")
YOUNG = alloc("young", ("GPU-a::1",), created=95.0)
HELD = alloc("held", ("GPU-a::2", "GPU-a::3"), created=0.0)
AGAIN = alloc("again", ("GPU-a::4",), created=0.0, allocated=95.0)  # old, but just handed out again


@pytest.mark.parametrize(
    "holders, keep, stale",
    [
        # no pod-resources API: nothing is stale, labels stay
        (None, {"old": "p0", "young": "", "held": "", "again": ""}, set()),
        # the API knows one container holding exactly HELD's devices
        (
            {frozenset({"GPU-a::2", "GPU-a::3"}): Holder("web", "prod", "main")},
            {"young": "", "held": "web", "again": ""},
            {"old"},
        ),
        # a container holds only part of HELD: HELD's container is gone
        ({frozenset({"GPU-a::2"}): Holder("x", "y", "z")}, {"young": "", "again": ""}, {"old", "held"}),
        # an empty list: only the allocation inside the grace period survives
        ({}, {"young": "", "again": ""}, {"old", "held"}),
    ],
)
def test_reconcile(holders, keep, stale):
    missing_since = {"old": 50.0, "young": 50.0, "held": 50.0, "again": 50.0}  # unlisted long enough
    result = reconcile([OLD, YOUNG, HELD, AGAIN], holders, now=100.0, grace=10.0, missing_since=missing_since)
    assert {a.allocation_id: a.pod for a in result.keep} == keep
    assert {a.allocation_id for a in result.stale} == stale


@pytest.mark.parametrize(
    "missing_since, now, stale, since_after",
    [
        # listed nowhere for the first time: kept, and the clock starts now
        ({}, 100.0, set(), {"old": 100.0, "held": 100.0}),
        # unlisted for less than the grace period in a row: kept, the first time carried on
        ({"old": 95.0, "held": 95.0}, 100.0, set(), {"old": 95.0, "held": 95.0}),
        # unlisted for the whole grace period: released
        ({"old": 90.0, "held": 95.0}, 100.0, {"old"}, {"held": 95.0}),
    ],
)
def test_reconcile_releases_only_after_a_grace_period_unlisted(missing_since, now, stale, since_after):
    result = reconcile([OLD, HELD], {}, now=now, grace=10.0, missing_since=missing_since)
    assert {a.allocation_id for a in result.stale} == stale
    assert result.missing_since == since_after


def test_reconcile_forgets_the_missing_time_of_a_listed_allocation_and_keeps_it_without_the_api():
    listed = {frozenset(HELD.device_ids): Holder("web", "prod", "main")}
    assert reconcile([HELD], listed, now=100.0, grace=10.0, missing_since={"held": 0.0}).missing_since == {}
    unknown = reconcile([HELD], None, now=100.0, grace=10.0, missing_since={"held": 0.0, "gone": 1.0})
    assert unknown.stale == [] and unknown.missing_since == {"held": 0.0}


def test_labels_gc_and_metrics_through_the_pod_resources_api(env, kubelet):
    pr = FakePodResources(str(env.pod_resources_socket))
    metrics = Metrics()
    used = {}
    g = gpus(80, 40)
    plugin = env.plugin(g, metrics=metrics, usage_reader=lambda path: used.get(path, {}), gc_grace=30.0)
    plugin.start()
    try:
        _, s = stub(plugin)
        web = [f"{g[0].uuid}::0", f"{g[0].uuid}::1"]
        batch = [f"{g[0].uuid}::9", f"{g[1].uuid}::0"]
        for ids in (web, batch):
            allocate(s, ids)
        by_devices = {a.device_ids: a for a in plugin.store.all()}
        web_a, batch_a = by_devices[tuple(sorted(web))], by_devices[tuple(sorted(batch))]
        used[os.path.join(web_a.region_dir, "region")] = {0: 3 * GIB}
        used[os.path.join(batch_a.region_dir, "region")] = {1: GIB}
        pr.pods = [
            ("web-0", "prod", "server", RESOURCE, web),
            ("other", "prod", "x", "nvidia.com/gpu", batch),  # another resource: not ours
        ]

        rows = plugin.tracker.tick(now=web_a.created + 1)  # young: nothing collected yet
        assert pr.calls == 1
        assert {(r.allocation_id, r.pod, r.gpu, r.limit_bytes, r.used_bytes) for r in rows} == {
            (web_a.allocation_id, "web-0", 0, 16 * GIB, 3 * GIB),
            (batch_a.allocation_id, "", 0, 8 * GIB, 0),
            (batch_a.allocation_id, "", 1, 4 * GIB, GIB),
        }
        labels = dict(allocation=web_a.allocation_id, pod="web-0", namespace="prod", container="server", gpu="0")
        assert metrics.registry.get_sample_value("mpsd_allocation_memory_used_bytes", labels) == 3 * GIB
        assert metrics.registry.get_sample_value("mpsd_allocation_memory_limit_bytes", labels) == 16 * GIB
        saved = json.load(open(env.state_path))
        assert {a["pod"] for a in saved["allocations"]} == {"web-0", ""}  # labels survive a restart

        rows = plugin.tracker.tick(now=batch_a.created + 60)  # batch is gone from the kubelet
        assert {r.allocation_id for r in rows} == {web_a.allocation_id}
        assert [a.allocation_id for a in plugin.store.all()] == [web_a.allocation_id]
        assert not os.path.exists(batch_a.region_dir) and os.path.isdir(web_a.region_dir)
        assert [a["allocation_id"] for a in json.load(open(env.state_path))["allocations"]] == [web_a.allocation_id]
        gone = dict(labels, allocation=batch_a.allocation_id, pod="", container="", namespace="", gpu="1")
        assert metrics.registry.get_sample_value("mpsd_allocation_memory_used_bytes", gone) is None
    finally:
        plugin.stop()
        pr.stop()


def test_devices_handed_out_again_are_not_collected_before_the_kubelet_lists_them(env, kubelet):
    import time

    pr = FakePodResources(str(env.pod_resources_socket))  # lists nobody yet
    g = gpus(80)
    plugin = env.plugin(g, usage_reader=lambda path: {})
    plugin.start()
    try:
        ids = (f"{g[0].uuid}::0",)
        _, s = stub(plugin)
        allocate(s, ids)
        (first,) = plugin.store.all()
        aged = replace(first, created=first.created - 3600, pod="old-pod")  # its pod ended an hour ago
        plugin.store.put(aged)
        allocate(s, ids)
        plugin.tracker.tick(now=time.time() + 1)
        (kept,) = plugin.store.all()
        assert kept.created > aged.created + 3000 and kept.region_dir != aged.region_dir  # a new pod's own
        assert os.path.isdir(kept.region_dir)
        plugin.tracker.tick(now=time.time() + 120)  # still not listed two minutes later: released
        assert plugin.store.all() == [] and not os.path.exists(kept.region_dir)
    finally:
        plugin.stop()
        pr.stop()


def test_an_empty_list_from_a_restarting_kubelet_releases_nothing(env, kubelet):
    pr = FakePodResources(str(env.pod_resources_socket))
    g = gpus(80)
    plugin = env.plugin(g, usage_reader=lambda path: {}, gc_grace=60.0)
    plugin.start()
    try:
        ids = [f"{g[0].uuid}::0", f"{g[0].uuid}::1"]
        _, s = stub(plugin)
        allocate(s, ids)
        (a,) = plugin.store.all()
        t = a.created + 3600  # a pod that has run for an hour
        pr.pods = [("web-0", "prod", "server", RESOURCE, ids)]
        plugin.tracker.tick(now=t)
        pr.pods = []  # the kubelet restarted and has not synced its pods yet
        plugin.tracker.tick(now=t + 10)
        plugin.tracker.tick(now=t + 40)
        assert [x.pod for x in plugin.store.all()] == ["web-0"] and os.path.isdir(a.region_dir)
        pr.pods = [("web-0", "prod", "server", RESOURCE, ids)]  # synced: listed again
        plugin.tracker.tick(now=t + 65)
        pr.pods = []  # the pod ends
        plugin.tracker.tick(now=t + 70)
        plugin.tracker.tick(now=t + 125)
        assert len(plugin.store.all()) == 1  # unlisted for 55 s only
        plugin.tracker.tick(now=t + 130)  # unlisted for the whole grace period
        assert plugin.store.all() == [] and not os.path.exists(a.region_dir)
    finally:
        plugin.stop()
        pr.stop()


def test_devices_handed_out_while_a_round_decides_are_not_released(env, kubelet, monkeypatch):
    import time

    import mpsd.plugin.usage as usage

    pr = FakePodResources(str(env.pod_resources_socket))  # lists nobody
    g = gpus(80)
    plugin = env.plugin(g, usage_reader=lambda path: {})
    plugin.start()
    try:
        ids = [f"{g[0].uuid}::0"]
        _, s = stub(plugin)
        allocate(s, ids)
        (first,) = plugin.store.all()
        plugin.store.put(replace(first, created=first.created - 3600, pod="old-pod"))  # ended an hour ago
        t0 = time.time()
        plugin.tracker.tick(now=t0)  # unlisted: the grace period starts
        assert len(plugin.store.all()) == 1
        decide = usage.reconcile

        def reconcile_then_allocate(*args, **kwargs):
            result = decide(*args, **kwargs)
            assert [a.allocation_id for a in result.stale] == [first.allocation_id]
            allocate(s, ids)  # meanwhile the kubelet hands the same devices to a new pod
            return result

        monkeypatch.setattr(usage, "reconcile", reconcile_then_allocate)
        plugin.tracker.tick(now=t0 + 120)  # unlisted for two minutes: decided stale
        (kept,) = plugin.store.all()
        assert kept.created >= first.created and kept.region_dir != first.region_dir  # the new pod's
        assert os.path.isdir(kept.region_dir)  # the new pod's region is still there
    finally:
        plugin.stop()
        pr.stop()


def test_labels_written_by_a_round_keep_an_allocate_made_meanwhile(env, kubelet, monkeypatch):
    import mpsd.plugin.usage as usage

    pr = FakePodResources(str(env.pod_resources_socket))
    g = gpus(80)
    plugin = env.plugin(g, usage_reader=lambda path: {})
    plugin.start()
    try:
        ids = [f"{g[0].uuid}::0"]
        _, s = stub(plugin)
        allocate(s, ids)
        (first,) = plugin.store.all()
        pr.pods = [("web-0", "prod", "server", RESOURCE, ids)]
        decide = usage.reconcile

        def reconcile_then_allocate(*args, **kwargs):
            result = decide(*args, **kwargs)
            allocate(s, ids)  # the kubelet allocates the same devices again meanwhile
            return result

        monkeypatch.setattr(usage, "reconcile", reconcile_then_allocate)
        plugin.tracker.tick()
        (now,) = plugin.store.all()
        assert now.pod == "web-0"
        assert now.created > first.created  # the second Allocate's record was not overwritten
        assert now.region_dir != first.region_dir
    finally:
        plugin.stop()
        pr.stop()


class BrokenPodResources(podresources_pb2_grpc.PodResourcesListerServicer):
    def List(self, request, context):
        context.abort(grpc.StatusCode.INTERNAL, "kubelet is unwell")


def test_unreachable_pod_resources_keeps_every_allocation(env, kubelet, caplog):
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(BrokenPodResources(), server)
    server.add_insecure_port("unix://" + str(env.pod_resources_socket))
    server.start()
    g = gpus(80)
    plugin = env.plugin(g, usage_reader=lambda path: {})
    plugin.start()
    try:
        _, s = stub(plugin)
        allocate(s, [f"{g[0].uuid}::0"])
        with caplog.at_level("WARNING", logger="mpsd.plugin.usage"):
            plugin.tracker.tick(now=1e12)
        assert len(plugin.store.all()) == 1
        assert "kubelet is unwell" in caplog.text
    finally:
        plugin.stop()
        server.stop(grace=0).wait()


def test_without_pod_resources_socket_nothing_is_collected(env, kubelet):
    g = gpus(80)
    plugin = env.plugin(g, usage_reader=lambda path: {})
    plugin.start()
    try:
        _, s = stub(plugin)
        allocate(s, [f"{g[0].uuid}::0"])
        rows = plugin.tracker.tick(now=1e12)
        assert [(r.pod, r.limit_bytes, r.used_bytes) for r in rows] == [("", 8 * GIB, 0)]
        assert len(plugin.store.all()) == 1
    finally:
        plugin.stop()


def test_gc_never_deletes_outside_the_region_dir(env, kubelet, tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    plugin = env.plugin(gpus(80))
    stray = Allocation("alloc-x", ("GPU-a::0",), ("GPU-a",), {0: GIB}, 10.0, str(outside), 0.0)
    plugin.store.put(stray)  # a state file naming a directory outside regionDir
    plugin.tracker.collect([stray])
    assert plugin.store.all() == []  # released
    assert outside.is_dir()  # but its directory left alone


def test_usage_loop_pushes_metrics_on_its_interval(env, kubelet):
    metrics = Metrics()
    g = gpus(80)
    plugin = env.plugin(g, metrics=metrics, usage_reader=lambda path: {0: 123}, usage_interval=0.05)
    plugin.start()
    try:
        _, s = stub(plugin)
        allocate(s, [f"{g[0].uuid}::0"])
        (a,) = plugin.store.all()
        labels = dict(allocation=a.allocation_id, pod="", namespace="", container="", gpu="0")
        assert wait_for(lambda: metrics.registry.get_sample_value("mpsd_allocation_memory_used_bytes", labels) == 123)
    finally:
        plugin.stop()


def test_shim_usage_of_a_region_nobody_opened_is_empty(tmp_path):
    assert shim_usage(str(tmp_path / "region")) == {}


def test_a_refused_allocation_region_is_counted_every_round_and_an_unopened_one_is_not(env, kubelet, shim_lib):
    metrics = Metrics()
    g = gpus(80)
    reader = lambda path: shim_usage(path, library=str(shim_lib))  # noqa: E731 - the real reader, this library
    plugin = env.plugin(g, metrics=metrics, usage_reader=reader)
    plugin.start()
    try:
        _, s = stub(plugin)
        allocate(s, [f"{g[0].uuid}::0"])
        allocate(s, [f"{g[0].uuid}::1"])
        bad, unopened = plugin.store.all()
        with open(os.path.join(bad.region_dir, "region"), "wb") as f:  # what a pod can write there
            f.write(b"not a region" * 1000)

        def refused(reason: str) -> float | None:
            return metrics.registry.get_sample_value(
                "mpsd_regions_refused_total", {"kind": "allocation", "reason": reason}
            )

        assert refused("corrupted") == 0  # exported from the start
        plugin.tracker.tick(now=bad.created + 1)
        plugin.tracker.tick(now=bad.created + 2)
        assert refused("corrupted") == 2
        assert refused("not_regular") == refused("too_large") == refused("unreadable") == 0
        assert os.path.isdir(unopened.region_dir)  # no region file yet: read as empty, not refused
    finally:
        plugin.stop()
