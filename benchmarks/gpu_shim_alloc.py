"""The shim's alloc+free cost against a chosen driver: the real libcuda.so.1, or the test fake.

    python benchmarks/gpu_shim_alloc.py --driver real|fake [--pairs N] [--rounds R]
        [--threads 1,8] [--sizes 4096,1048576] [--json FILE]

Compiles benchmarks/shim_alloc.c linked against that driver's libcuda.so.1 (the real one is
found the way a program finds it: dlopen by soname, then its path from /proc/self/maps),
builds libmpsshim.so from csrc/, then for each size and thread count alternates bare runs and
runs under LD_PRELOAD=libmpsshim.so with a cap the pairs never reach. Wall ns per pair is the
best of the R runs (load only ever adds to it). Prints a table; --json writes every figure.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.fakes import build_fake_cuda  # noqa: E402

CAP = "0=1G"  # far above the 1 MiB pairs, far below any card


def real_libcuda() -> Path:
    """The path of the libcuda.so.1 this machine's dynamic loader picks."""
    ctypes.CDLL("libcuda.so.1")
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith("libcuda.so"):
            return Path(path)
    raise OSError("libcuda.so.1 loaded but not found in /proc/self/maps")


def build(work: Path, driver: str) -> tuple[Path, Path, dict[str, str]]:
    """(benchmark program, shim, environment for the bare run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_MPS_", "MPSSHIM_")) and k != "LD_PRELOAD"}
    if driver == "fake":
        fake = build_fake_cuda(work / "fake")
        lib = fake / "libcuda.so.1"
        env.update(LD_LIBRARY_PATH=str(fake), FAKE_CUDA_DEVICES="16G")
    else:
        lib = real_libcuda()
    shim = work / "libmpsshim.so"
    subprocess.run(["make", "-s", "-C", str(REPO / "csrc"), f"OUT={shim}", "lib"], check=True)
    exe = work / "shim_alloc"
    subprocess.run(
        [
            os.environ.get("CC", "cc"),
            "-O2",
            "-std=gnu11",
            "-Wall",
            "-Wextra",
            "-Werror",
            str(REPO / "benchmarks" / "shim_alloc.c"),
            "-o",
            str(exe),
            str(lib),
            "-lpthread",
        ],
        check=True,
    )
    return exe, shim, env


def parse(line: str) -> dict[str, float]:
    return {k: float(v) for k, v in (field.split("=", 1) for field in line.split())}


def run_once(exe: Path, env: dict[str, str], threads: int, pairs: int, size: int) -> dict[str, float]:
    out = subprocess.run(
        [str(exe), str(threads), str(pairs), str(size)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = parse(out.stdout.strip().splitlines()[-1])
    if result.get("refused"):
        raise RuntimeError(f"{result['refused']:.0f} allocations were refused: is the GPU busy or the cap too small?")
    return result


def summarise(bare: list[dict[str, float]], shim: list[dict[str, float]]) -> dict[str, float]:
    b = min(r["wall_ns_per_pair"] for r in bare)
    s = min(r["wall_ns_per_pair"] for r in shim)
    return {"bare_ns": round(b, 1), "shim_ns": round(s, 1), "added_ns": round(s - b, 1), "ratio": round(s / b, 3)}


def measure(driver: str, pairs: int, rounds: int, threads: list[int], sizes: list[int]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gpu-shim-alloc-") as tmp:
        work = Path(tmp)
        exe, shim, bare = build(work, driver)
        shimmed = {
            **bare,
            "LD_PRELOAD": str(shim),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": CAP,
            "MPSSHIM_REGION": str(work / "region"),
        }
        rows = []
        for size in sizes:
            for t in threads:
                runs: dict[str, list[dict[str, float]]] = {"bare": [], "shim": []}
                for _ in range(rounds):
                    runs["bare"].append(run_once(exe, bare, t, pairs, size))
                    runs["shim"].append(run_once(exe, shimmed, t, pairs, size))
                rows.append({"bytes": size, "threads": t, **summarise(runs["bare"], runs["shim"])})
    return {
        "driver": driver,
        "pairs_per_thread": pairs,
        "rounds": rounds,
        "cap": CAP,
        "rows": rows,
        "command": " ".join(
            [
                "benchmarks/gpu_shim_alloc.py",
                "--driver",
                driver,
                "--pairs",
                str(pairs),
                "--rounds",
                str(rounds),
                "--threads",
                ",".join(map(str, threads)),
                "--sizes",
                ",".join(map(str, sizes)),
            ]
        ),
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{'bytes':>8} {'threads':>7} {'bare ns':>9} {'shim ns':>9} {'added ns':>9} {'ratio':>6}"]
    for r in result["rows"]:
        lines.append(
            f"{r['bytes']:>8} {r['threads']:>7} {r['bare_ns']:>9.1f} {r['shim_ns']:>9.1f} "
            f"{r['added_ns']:>9.1f} {r['ratio']:>6.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--driver", choices=("real", "fake"), required=True)
    ap.add_argument("--pairs", type=int, default=20_000, help="pairs per thread per run (default 20000)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per configuration, best is kept (default 3)")
    ap.add_argument("--threads", default="1,8")
    ap.add_argument("--sizes", default="4096,1048576")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    result = measure(
        args.driver,
        args.pairs,
        args.rounds,
        [int(t) for t in args.threads.split(",")],
        [int(s) for s in args.sizes.split(",")],
    )
    print(f"alloc+free pairs against the {args.driver} driver, {args.pairs} per thread, best of {args.rounds}")
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
