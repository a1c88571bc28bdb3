"""Per-pod labels from the pod-resources API, garbage collection of stale allocations, and
per-allocation usage pushed to the real Metrics."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import grpc
import pytest

from mpsd.metrics import Metrics
from mpsd.plugin import podresources_pb2_grpc
from mpsd.plugin.kubelet import Holder
from mpsd.plugin.state import Allocation
from mpsd.plugin.usage import reconcile, shim_usage

from .conftest import GIB, RESOURCE, FakePodResources, allocate, gpus, stub, wait_for


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
    result = reconcile([OLD, YOUNG, HELD, AGAIN], holders, now=100.0, grace=10.0)
    assert {a.allocation_id: a.pod for a in result.keep} == keep
    assert {a.allocation_id for a in result.stale} == stale


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
        assert kept.created == aged.created and kept.allocated > aged.created + 3000
        assert os.path.isdir(kept.region_dir)
        plugin.tracker.tick(now=time.time() + 120)  # still not listed two minutes later: released
        assert plugin.store.all() == [] and not os.path.exists(kept.region_dir)
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
    plugin.tracker.collect([stray])
    assert outside.is_dir()


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
