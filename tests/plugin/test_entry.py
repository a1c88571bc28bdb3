"""run_plugin as `mpsd run` calls it, and per-allocation usage read from a real accounting
region (written by the shim's core, read through libmpsshim.so)."""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

from mpsd.config import load
from mpsd.lifecycle.health import HealthBoard
from mpsd.registry import Metrics
from mpsd.plugin import run_plugin
from mpsd.alloc.usage import shim_usage
from tests.regionholder import hold

from tests.plugin.conftest import GIB, FakeKubelet, allocate, gpus, stub

REPO = Path(__file__).resolve().parents[2]


def test_run_plugin_serves_until_stopped(short_dir):
    shim_lib = short_dir / "libmpsshim.so"  # only copied here, never loaded
    shim_lib.write_bytes(b"\x7fELF stand-in")
    kubelet_dir = short_dir / "kubelet"
    kubelet_dir.mkdir()
    kubelet = FakeKubelet(str(kubelet_dir / "kubelet.sock"))
    config = load(
        None,
        {},
        {
            "stateDir": str(short_dir / "state"),
            "devicePlugin.kubeletDir": str(kubelet_dir),
            "devicePlugin.podResourcesSocket": str(short_dir / "none.sock"),
            "devicePlugin.regionDir": str(short_dir / "regions"),
            "devicePlugin.shimHostDir": str(short_dir / "lib"),
            "devicePlugin.slicesPerGpu": 4,
        },
    )
    stop = threading.Event()
    board = HealthBoard()
    g = gpus(40)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            run_plugin(config, pipe_dir=str(short_dir / "pipe"), gpus=g, board=board, metrics=Metrics(),
                       shim_library=str(shim_lib), stop=stop)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert kubelet.registered.wait(10), errors
        req = kubelet.requests[0]
        assert (req.resource_name, req.version) == ("mpsd.io/gpu", "v1beta1")
        assert (short_dir / "lib" / "libmpsshim.so.3").read_bytes() == shim_lib.read_bytes()
        _, s = stub(str(kubelet_dir / req.endpoint))
        reply = allocate(s, [f"{g[0].uuid}::0"])
        assert reply.container_responses[0].envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10G"
        assert (short_dir / "state" / "device-plugin-state.json").exists()
    finally:
        stop.set()
        thread.join(15)
        kubelet.stop()
    assert not thread.is_alive() and not errors
    assert not (kubelet_dir / req.endpoint).exists()


def test_usage_of_an_allocation_comes_from_its_region(env, kubelet, holder_exe, shim_lib):
    metrics = Metrics()
    g = gpus(80)
    plugin = env.plugin(g, metrics=metrics, usage_reader=functools.partial(shim_usage, library=str(shim_lib)))
    plugin.start()
    holders = []
    try:
        _, s = stub(plugin)
        allocate(s, [f"{g[0].uuid}::0", f"{g[0].uuid}::1"])
        (a,) = plugin.store.all()
        region = os.path.join(a.region_dir, "region")
        assert [r.used_bytes for r in plugin.tracker.tick()] == [0]  # no process yet, no region file
        # two processes of the container, each charging against the container's cap
        for size in (3 * GIB, GIB):
            holders.append(hold(holder_exe, region, f"0:{16 * GIB}:{size}"))
        (row,) = plugin.tracker.tick()
        assert (row.limit_bytes, row.used_bytes) == (16 * GIB, 4 * GIB)
        labels = dict(allocation=a.allocation_id, pod="", namespace="", container="", gpu="0")
        assert metrics.registry.get_sample_value("mpsd_allocation_memory_used_bytes", labels) == 4 * GIB
        holders[0].kill()  # a process of the container dies holding 3 GiB
        holders[0].wait()
        holders.append(hold(holder_exe, region, f"0:{16 * GIB}:0"))  # the next process to open the region
        (row,) = plugin.tracker.tick()
        assert row.used_bytes == GIB  # the dead process's memory was given back
    finally:
        for p in holders:
            p.kill()
            p.wait()
        plugin.stop()
