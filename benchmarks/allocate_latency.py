"""Latency of the device plugin's Allocate, called through gRPC on a unix socket as the kubelet
calls it.

    .venv/bin/python benchmarks/allocate_latency.py [--calls 1000] [--gpus 8] [--slices 10] [--live 50]

Two runs of ``--calls`` calls each:
- new:    every call is a new allocation (a fresh region directory created, one journal line
          appended to the state and fdatasync'd before the answer); after each timed call the
          allocation is released again (untimed), so the state holds ``--live`` other
          allocations throughout;
- repeat: the same device IDs again (a new pod on the same slices): a fresh directory again
          (a pod never inherits the previous tenant's), the record replaced by one journal line.
The state's snapshot is rewritten (tmp + fsync + rename + directory fsync) only by compaction,
off Allocate's path (plugin start, the usage round, every 4096 journal lines).
Prints p50, p99, mean and max in milliseconds. Everything lives in a temporary directory
under $TMPDIR (the journal's fdatasync goes to that file system).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpsd.lifecycle.health import HealthBoard  # noqa: E402
from mpsd.plugin import DevicePlugin, api_pb2, api_pb2_grpc  # noqa: E402
from mpsd.alloc.container import HostPaths  # noqa: E402
from mpsd.alloc.slicing import advertised_ids, plan_allocation  # noqa: E402


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    memory_total: int


def percentile(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(round(q * (len(sorted_ms) - 1))))]


def summary(name: str, samples_ns: list[int]) -> str:
    ms = sorted(s / 1e6 for s in samples_ns)
    return (
        f"{name:7s} calls={len(ms)} p50={percentile(ms, 0.50):.3f}ms p99={percentile(ms, 0.99):.3f}ms "
        f"mean={statistics.fmean(ms):.3f}ms max={ms[-1]:.3f}ms"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--slices", type=int, default=10)
    ap.add_argument("--live", type=int, default=50, help="other allocations kept in the state file")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the plugin logs every allocation at INFO

    root = tempfile.mkdtemp(prefix="dpbench")
    gpus = [Gpu(i, f"GPU-{i:08x}-0000-0000-0000-{i:012x}", 80 << 30) for i in range(args.gpus)]
    paths = HostPaths(pipe_dir=f"{root}/pipe", region_dir=f"{root}/regions", shim_host_dir=f"{root}/lib")
    plugin = DevicePlugin(
        gpus=gpus, resource_name="mpsd.io/gpu", slices_per_gpu=args.slices, kubelet_dir=f"{root}/kubelet",
        paths=paths, state_path=f"{root}/state/state.json", board=HealthBoard(), usage_interval=0, poll_interval=5.0,
    )
    plugin.start()
    rng = random.Random(args.seed)
    every = advertised_ids(gpus, args.slices)
    try:
        for i in range(args.live):  # the allocations already on the node: one slice each
            plugin.servicer.record(plan_allocation([every[i % len(every)]], gpus, args.slices))
        channel = grpc.insecure_channel("unix://" + plugin.socket_path, options=[("grpc.enable_http_proxy", 0)])
        stub = api_pb2_grpc.DevicePluginStub(channel)

        def call(ids: list[str]) -> int:
            req = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)])
            t0 = time.perf_counter_ns()
            stub.Allocate(req, timeout=10)
            return time.perf_counter_ns() - t0

        def request() -> list[str]:
            gpu = rng.randrange(args.gpus)
            k = rng.randint(1, args.slices)
            return [f"{gpus[gpu].uuid}::{s}" for s in rng.sample(range(args.slices), k)]

        for _ in range(50):  # warm up the channel and the server's threads
            call(request())
        def release(aid: str) -> None:  # as garbage collection does it (untimed)
            a = plugin.store.get(aid)
            if a is not None:
                plugin.tracker.collect([a])

        new = []
        for _ in range(args.calls):
            ids = request()
            aid = plan_allocation(ids, gpus, args.slices).allocation_id
            release(aid)  # make sure it is new
            new.append(call(ids))
            release(aid)
        same = request()
        call(same)
        repeat = [call(same) for _ in range(args.calls)]
        channel.close()
    finally:
        plugin.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"gpus={args.gpus} slices_per_gpu={args.slices} live_allocations={args.live} "
        f"python={sys.version.split()[0]} grpc={grpc.__version__}"
    )
    print(summary("new", new))
    print(summary("repeat", repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
