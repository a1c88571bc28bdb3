"""Cost the shim adds to an alloc+free pair (cuMemAlloc_v2 + cuMemFree_v2 on the fake driver).

    .venv/bin/python benchmarks/shim_alloc.py [--pairs N] [--rounds R] [--threads 1,8]

Builds the fake libcuda.so.1 (tests/fakes), libmpsshim.so (csrc) and benchmarks/shim_alloc.c
into a temporary directory, then for each thread count runs the program R times bare and R times
under LD_PRELOAD=libmpsshim.so (alternating, so drift hits both alike) with a cap the pairs
never reach, and prints ns per pair for both, the ratio and the ns added.
Wall ns per pair = first thread's start to last thread's end / all pairs of all threads, best
of the R runs (other load on the machine only ever adds to it); CPU ns = the threads' own CPU
time / all pairs, median of the R runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.fakes import build_fake_cuda  # noqa: E402

BYTES = 1 << 20


def build(work: Path) -> tuple[Path, Path, Path]:
    fake = build_fake_cuda(work / "fake")
    shim = work / "libmpsshim.so"
    subprocess.run(["make", "-s", "-C", str(REPO / "csrc"), f"OUT={shim}", "lib"], check=True)
    exe = work / "shim_alloc"
    subprocess.run(
        ["cc", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", str(REPO / "benchmarks/shim_alloc.c"),
         "-o", str(exe), f"-L{fake}", "-lcuda", "-lpthread"],
        check=True,
    )
    return fake, shim, exe


def parse(line: str) -> dict[str, float]:
    return {k: float(v) for k, v in (field.split("=") for field in line.split())}


def run_once(exe: Path, env: dict[str, str], threads: int, pairs: int) -> dict[str, float]:
    out = subprocess.run([str(exe), str(threads), str(pairs), str(BYTES)], env=env, check=True, capture_output=True, text=True)
    result = parse(out.stdout.strip())
    if result["refused"]:
        raise RuntimeError(f"{result['refused']:.0f} allocations were refused: the benchmark's cap is too small")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200_000, help="pairs per thread per run (default 200000)")
    ap.add_argument("--rounds", type=int, default=7, help="runs per configuration; medians are reported (default 7)")
    ap.add_argument("--threads", default="1,8", help="comma-separated thread counts (default 1,8)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shim-bench-") as tmp:
        work = Path(tmp)
        fake, shim, exe = build(work)
        base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "MPSSHIM_DISABLE")}
        bare = {**base, "LD_LIBRARY_PATH": str(fake), "FAKE_CUDA_DEVICES": "16G"}
        shimmed = {**bare, "LD_PRELOAD": str(shim), "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G", "MPSSHIM_REGION": str(work / "region")}
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"alloc+free pairs of {BYTES} bytes, {args.pairs} per thread, {args.rounds} runs each (wall: best run, cpu: median); {os.cpu_count()} cores, load {load}")
        print(f"{'threads':>7} {'bare ns':>9} {'shim ns':>9} {'ratio':>6} {'added ns':>9} {'bare cpu':>9} {'shim cpu':>9} {'added cpu':>9}")
        for threads in (int(t) for t in args.threads.split(",")):
            runs: dict[str, list[dict[str, float]]] = {"bare": [], "shim": []}
            for _ in range(args.rounds):
                runs["bare"].append(run_once(exe, bare, threads, args.pairs))
                runs["shim"].append(run_once(exe, shimmed, threads, args.pairs))
            med = {
                name: {"wall_ns_per_pair": min(r["wall_ns_per_pair"] for r in rs), "cpu_ns_per_pair": statistics.median(r["cpu_ns_per_pair"] for r in rs)}
                for name, rs in runs.items()
            }
            b, s = med["bare"], med["shim"]
            print(
                f"{threads:>7} {b['wall_ns_per_pair']:>9.1f} {s['wall_ns_per_pair']:>9.1f} "
                f"{s['wall_ns_per_pair'] / b['wall_ns_per_pair']:>6.2f} {s['wall_ns_per_pair'] - b['wall_ns_per_pair']:>9.1f} "
                f"{b['cpu_ns_per_pair']:>9.1f} {s['cpu_ns_per_pair']:>9.1f} {s['cpu_ns_per_pair'] - b['cpu_ns_per_pair']:>9.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
