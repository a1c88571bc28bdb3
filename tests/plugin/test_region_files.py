"""A pod owns its allocation directory, so its ``region`` may be anything: a FIFO (opening it
would block the plugin's usage and GC thread forever), a symlink to a host file (the plugin is
root on the host). The plugin reads real regions through the real libmpsshim.so, skips those
with one logged line, and its rounds (labels, garbage collection, metrics) keep going."""

from __future__ import annotations

import functools
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from mpsd.registry import Metrics
from mpsd.alloc.usage import shim_usage
from tests.regionholder import hold, reader_survives_truncation

from tests.plugin.conftest import GIB, RESOURCE, FakePodResources, allocate, gpus, stub

REPO = Path(__file__).resolve().parents[2]


def tick_within(plugin, seconds: float, now: float):
    """One usage round on a thread; the rows, or a failure if it has not ended in ``seconds``."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(plugin.tracker.tick(now=now)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"usage round still running after {seconds}s (blocked on a pod's file)"
    return result[0]


def release_fifo(path: str) -> None:
    """Unblock a reader stuck in open() of the FIFO (old code), so the test leaves no thread behind."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_pods_fifo_or_symlink_region_is_skipped_and_rounds_go_on(env, kubelet, shim_lib, holder_exe, tmp_path,
                                                                   caplog, kind):
    pr = FakePodResources(str(env.pod_resources_socket))
    metrics = Metrics()
    g = gpus(80)
    plugin = env.plugin(g, metrics=metrics, usage_reader=functools.partial(shim_usage, library=str(shim_lib)),
                        gc_grace=30.0)
    plugin.start()
    procs = []
    hostile_region = ""
    try:
        _, s = stub(plugin)
        hostile_ids, good_ids, ended_ids = ([f"{g[0].uuid}::{k}"] for k in range(3))
        for ids in (hostile_ids, good_ids, ended_ids):
            allocate(s, ids)
        by_ids = {a.device_ids: a for a in plugin.store.all()}
        hostile, good, ended = (by_ids[tuple(i)] for i in (hostile_ids, good_ids, ended_ids))
        plugin.store.put(replace(ended, created=ended.created - 3600))  # its pod ended an hour ago
        procs.append(hold(holder_exe, os.path.join(good.region_dir, "region"), f"0:{8 * GIB}:{2 * GIB}"))
        hostile_region = os.path.join(hostile.region_dir, "region")
        if kind == "fifo":
            os.mkfifo(hostile_region, 0o666)
        else:  # a host file the pod must not get the plugin to read: here a real region holding 5 GiB
            host_file = tmp_path / "host-secret"
            procs.append(hold(holder_exe, host_file, f"0:{8 * GIB}:{5 * GIB}"))
            os.symlink(host_file, hostile_region)
        pr.pods = [("bad", "t", "c", RESOURCE, hostile_ids), ("good", "t", "c", RESOURCE, good_ids)]
        now = time.time()
        with caplog.at_level("WARNING", logger="mpsd.plugin.usage"):
            tick_within(plugin, 10, now)  # the ended allocation goes unlisted: its grace starts
            rows = tick_within(plugin, 10, now + 60)
            tick_within(plugin, 10, now + 70)  # warned once per allocation, not every round
        assert {(r.pod, r.used_bytes) for r in rows} == {("bad", 0), ("good", 2 * GIB)}
        assert [a.allocation_id for a in plugin.store.all()] == sorted([hostile.allocation_id, good.allocation_id],
                                                                       key=lambda i: plugin.store.get(i).created)
        assert not os.path.exists(ended.region_dir)  # garbage collection went on
        labels = dict(allocation=good.allocation_id, pod="good", namespace="t", container="c", gpu="0")
        assert metrics.registry.get_sample_value("mpsd_allocation_memory_used_bytes", labels) == 2 * GIB
        warned = [r.getMessage() for r in caplog.records if hostile_region in r.getMessage()]
        assert len(warned) == 1 and "\n" not in warned[0], warned
        assert ("not a regular file" if kind == "fifo" else "symbolic link") in warned[0]
    finally:
        if kind == "fifo" and hostile_region:
            release_fifo(hostile_region)
        for p in procs:
            p.kill()
            p.wait()
        plugin.stop()
        pr.stop()


READER = """
import sys, time
from mpsd.plugin.usage import shim_usage
region, lib = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 8
reads = 0
while time.monotonic() < deadline:
    try:
        shim_usage(region, library=lib)
    except Exception:
        pass
    reads += 1
print(reads)
"""


def test_a_pod_truncating_its_region_while_it_is_read_cannot_kill_the_reader(shim_lib, holder_exe, tmp_path):
    # the reader is mpsd itself (the plugin runs in `mpsd run`): a SIGBUS there would take the
    # control daemon and every MPS client of the node with it
    region = tmp_path / "region"
    holder = hold(holder_exe, region, f"0:{8 * GIB}:{GIB}")
    reader_survives_truncation(holder, region, READER, str(region), str(shim_lib))
