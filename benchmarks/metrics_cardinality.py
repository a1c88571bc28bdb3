"""Cardinality and scrape time of mpsd's /metrics on a full node.

    .venv/bin/python benchmarks/metrics_cardinality.py [--pods 110] [--regions 256] [--processes 1]
        [--gpus 8] [--scrapes 200] [--churn 100]

A node as mpsd sees it: ``--pods`` device-plugin allocations (110 is the kubelet's default pod
limit), ``--regions`` mpsd exec regions (256 is the most one round reads) with ``--processes``
live processes each, every pod and region process an NVML MPS client, on ``--gpus`` GPUs. The
values go into mpsd.registry.Metrics through the setters mpsd calls, and /metrics is fetched over
HTTP from mpsd's own server (mpsd.metrics.http.serve), as Prometheus fetches it.

1. series: the series count at 0, 1/4, 1/2 and all of the pods and regions, and with one more
   process per region: it must grow by a constant number per pod, per region and per process.
2. scrape: ``--scrapes`` GETs of /metrics at full size, one after the other, while a thread
   pushes a fresh node state every 0.5 s (as the inventory and usage rounds do); p50, p99, max;
   and the CPU time of rendering the text alone (what a busy machine's wall time multiplies).
3. churn: ``--churn`` rounds each replacing every pod and region by new ones (new names, new
   pids): the series count afterwards must equal the count before (no label set outlives its
   pod, region or process).
Exits 1 when series do not grow linearly or churn leaves series behind.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpsd.metrics.regions import RegionUsage  # noqa: E402
from mpsd.inventory.nvml import Client, Gpu  # noqa: E402
from mpsd.plugin.metrics import AllocationUsage  # noqa: E402
from mpsd.dra.metrics import ClaimUsage
from mpsd.registry import Metrics
from mpsd.metrics.http import serve

G = 1 << 30


def world(m: Metrics, tag: str, pods: int, regions: int, gpus: int = 2, processes: int = 1, claims: int = 0) -> None:
    """Push one node's state: ``pods`` allocations, ``regions`` exec regions with ``processes``
    processes each, every one of them an NVML client, and ``claims`` prepared DRA claims (none
    by default: a node serves the device plugin or the DRA driver); names and pids carry ``tag``,
    so two worlds with different tags share no per-pod, per-region, per-claim or per-process label."""
    base = 1000 * (1 + sum(map(ord, tag)))
    pids = [[base + 64 * r + p for p in range(processes)] for r in range(regions)]
    m.set_last_error(f"error in world {tag}")
    m.set_mps_servers(dict.fromkeys(range(gpus), 1))
    m.set_device_health(dict.fromkeys(range(gpus), True))
    m.observe_inventory(
        [Gpu(g, f"GPU-{tag}-{g}", "H100", 80 * G, G, (9, 0), False) for g in range(gpus)],
        [Client(i % gpus, pid, G) for i, pid in enumerate([base - 1 - i for i in range(pods)] + sum(pids, []))],
    )
    m.set_allocations(
        AllocationUsage(f"alloc-{tag}-{i}", f"pod-{tag}-{i}", "ns", "c", i % gpus, 8 * G, G) for i in range(pods)
    )
    m.set_regions(
        RegionUsage(f"region-{tag}-{r}", 0, 4 * G, G, tuple((pid, G) for pid in pids[r])) for r in range(regions)
    )
    m.set_claims(
        ClaimUsage(f"claim-{tag}-{i}", "ns", f"pod-{tag}-{i}", i % gpus, 4 * G, 25.0, G) for i in range(claims)
    )
    m.set_device_taints({0: ("MPSServerFault", "NoSchedule")} if claims else {})  # a DRA node with a tainted GPU
    m.set_dra_device_health({f"gpu-{g}": "healthy" for g in range(gpus)} if claims else {})  # a DRA node's devices


def series_count(m: Metrics) -> int:
    return sum(1 for line in m.scrape().decode().splitlines() if line and not line.startswith("#"))


def count_of(pods: int, regions: int, gpus: int, processes: int) -> int:
    m = Metrics()
    world(m, "x", pods, regions, gpus, processes)
    return series_count(m)


def growth(pods: int, regions: int, gpus: int, processes: int) -> bool:
    """Fit series = base + a*pods + regions*(b + c*processes) from single-kind nodes, then
    check it on mixed ones."""
    base = count_of(0, 0, gpus, processes)
    per_pod = (count_of(pods, 0, gpus, processes) - base) / pods
    per_region = (count_of(0, regions, gpus, processes) - base) / regions
    per_process = (count_of(0, regions, gpus, processes + 1) - base) / regions - per_region
    print(f"1. series (gpus={gpus})")
    print(f"   {'pods':>5} {'regions':>7} {'procs/region':>12} {'series':>7} {'fit':>7}")
    ok = True
    for frac in (0, 0.25, 0.5, 1):
        for procs in (processes, processes + 1):
            p, r = int(pods * frac), int(regions * frac)
            n = count_of(p, r, gpus, procs)
            fit = base + per_pod * p + (per_region + per_process * (procs - processes)) * r
            ok &= abs(fit - n) < 1e-6
            print(f"   {p:>5} {r:>7} {procs:>12} {n:>7} {fit:>7g}")
    print(f"   = {base} + {per_pod:g} per pod + {per_region - per_process * processes:g} per region "
          f"+ {per_process:g} per process: {'linear' if ok else 'NOT LINEAR'}")  # fmt: skip
    return ok


def scrape_times(pods: int, regions: int, gpus: int, processes: int, scrapes: int) -> None:
    m = Metrics()
    world(m, "full", pods, regions, gpus, processes)
    stop = threading.Event()

    def pusher() -> None:  # the inventory and usage rounds, replacing the state meanwhile
        i = 0
        while not stop.wait(0.5):
            i += 1
            world(m, "full", pods, regions, gpus, processes)

    thread = threading.Thread(target=pusher, daemon=True)
    with serve("127.0.0.1:0", m, lambda: True, lambda: True) as server:
        thread.start()
        url = f"http://127.0.0.1:{server.port}/metrics"
        times, size = [], 0
        for _ in range(scrapes):
            began = time.perf_counter()
            with urllib.request.urlopen(url, timeout=30) as resp:
                size = len(resp.read())
            times.append((time.perf_counter() - began) * 1000)
        stop.set()
        thread.join()
    times.sort()
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
    cpu = time.process_time()
    for _ in range(20):
        m.scrape()
    cpu_ms = (time.process_time() - cpu) / 20 * 1000
    print(f"2. scrape: {series_count(m)} series, {size} bytes; {scrapes} scrapes over HTTP: "
          f"p50 {statistics.median(times):.1f} ms, p99 {p99:.1f} ms, max {times[-1]:.1f} ms; "
          f"CPU time of one scrape's text alone {cpu_ms:.1f} ms")  # fmt: skip


def churn(pods: int, regions: int, gpus: int, processes: int, rounds: int) -> bool:
    m = Metrics()
    world(m, "start", pods, regions, gpus, processes)
    before = series_count(m)
    began = time.perf_counter()
    for i in range(rounds):
        world(m, f"churn{i}", pods, regions, gpus, processes)
    took = (time.perf_counter() - began) / max(rounds, 1) * 1000
    after = series_count(m)
    print(f"3. churn: {rounds} rounds of new pods, regions and pids ({took:.1f} ms per round): "
          f"series {before} before, {after} after")  # fmt: skip
    return before == after


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=110)
    ap.add_argument("--regions", type=int, default=256)
    ap.add_argument("--processes", type=int, default=1, help="live processes per region")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--churn", type=int, default=100)
    a = ap.parse_args(argv)
    if a.pods < 4 or a.regions < 4 or a.processes < 1 or a.gpus < 1:
        ap.error("expected --pods >= 4, --regions >= 4, --processes >= 1, --gpus >= 1")
    linear = growth(a.pods, a.regions, a.gpus, a.processes)
    scrape_times(a.pods, a.regions, a.gpus, a.processes, a.scrapes)
    steady = churn(a.pods, a.regions, a.gpus, a.processes, a.churn)
    return 0 if linear and steady else 1


if __name__ == "__main__":
    sys.exit(main())
