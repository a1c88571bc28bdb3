"""Cost the shim adds to a cuMemAlloc_v2 + cuMemFree_v2 pair, every shape in one run.

    .venv/bin/python benchmarks/shim_alloc.py [--shim LABEL=PATH]... [--json FILE]
        [--paths link,dlsym,gpa] [--sizes 4096,1048576] [--threads 1,8] [--procs 1,2]
        [--hami LABEL=PATH]... [--pairs N] [--rounds R] [--warmup W] [--driver fake|real]

Builds the client benchmarks/shim_alloc.c into a temporary directory, against the fake
libcuda.so.1 (tests/fakes, bound to itself like NVIDIA's; the default) or, with --driver real,
against the libcuda.so.1 this machine's loader finds (a GPU machine: tests/gpu runs it so). Each
--shim is a libmpsshim.so to measure (several: e.g. --shim before=old.so --shim after=new.so
compares two builds in one run); with none, the shim is built from this checkout and labelled
"shim". Each --hami is a HAMi-core libvgpu.so measured beside them with its own settings
(benchmarks/hami_core.sh builds one against the fake driver). For every shape (how the client
reaches the driver, allocation size, threads per process, processes) it runs the client R times
bare and R times under each library, alternating so drift hits all alike. Under a library the
cap is 8 GiB on a 16 GiB fake device (never reached: every pair takes the whole charging path),
and the processes of one run share one fresh region file.

Figures, per shape and library: ns per pair = wall time from the first thread's start to the last
thread's end (across the processes) / all pairs of all threads and processes (for 8 threads an
aggregate: inverse throughput); median of the R runs, best run in the JSON too. "added" is
the shim's median minus the bare median, "ratio" the shim's over the bare. The bare figure is
the fake driver's own cost; calls/pair counts the driver calls made per pair (2 = the pair
itself, more = lookups the shim makes through the driver). Prints a table; --json writes every
run, --markdown the table as docs/benchmarks.md shows it.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TARGET_ONE, TARGET_MANY = 100.0, 200.0  # ns added per pair: single-threaded, aggregate with threads


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")


def real_libcuda() -> Path:
    """The libcuda.so.1 this machine's dynamic loader picks (found as a program finds it)."""
    ctypes.CDLL("libcuda.so.1")
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith("libcuda.so"):
            return Path(path)
    raise SystemExit("libcuda.so.1 loaded but not found in /proc/self/maps")


def build(work: Path, want_shim: bool, driver: str = "fake") -> tuple[Path | None, Path, Path, Path | None]:
    """The fake driver's directory (None for the real driver), the plain and linked clients, and
    the checkout's shim if wanted."""
    fake: Path | None = None
    if driver == "fake":
        fake = work / "fake"
        _run(["make", "-s", "-C", str(REPO / "tests/fakes"), f"OUT_DIR={fake}",
              "LDFLAGS=-shared -Wl,-Bsymbolic-functions", "cuda", "nvml"])  # fmt: skip (HAMi-core needs NVML)
        libcuda = fake / "libcuda.so.1"
    else:
        libcuda = real_libcuda()
    src = str(REPO / "benchmarks/shim_alloc.c")
    flags = [os.environ.get("CC", "cc"), "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror"]
    plain, linked = work / "shim_alloc", work / "shim_alloc_link"
    _run([*flags, src, "-o", str(plain), "-ldl", "-lpthread"])
    _run([*flags, "-DLINKED", src, "-o", str(linked), str(libcuda), "-ldl", "-lpthread"])
    shim = None
    if want_shim:
        shim = work / "libmpsshim.so"
        _run(["make", "-s", "-C", str(REPO / "csrc"), f"OUT={shim}", "lib"])
    return fake, plain, linked, shim


def parse_libs(shim_specs: list[str], hami_specs: list[str]) -> dict[str, tuple[str, Path]]:
    """--shim and --hami LABEL=PATH: label -> (kind, library), in the order given."""
    libs: dict[str, tuple[str, Path]] = {}
    for kind, specs in (("shim", shim_specs), ("hami", hami_specs)):
        for spec in specs:
            label, sep, path = spec.partition("=")
            if not sep or not label or not path or label == "bare" or label in libs:
                raise SystemExit(f"--{kind} {spec!r}: expected LABEL=PATH with a new label other than 'bare'")
            if not Path(path).is_file():
                raise SystemExit(f"--{kind} {spec!r}: {path} is not a file")
            libs[label] = (kind, Path(path).resolve())
    return libs


def lib_env(kind: str, lib: Path, state: Path) -> dict[str, str]:
    """What a run under a library sets: a cap of 8 GiB (never reached by the pairs) and its
    accounting file at `state` (plus a suffix), fresh per run and shared by the run's processes."""
    if kind == "hami":  # HAMi-core's own settings (its README)
        return {
            "LD_PRELOAD": str(lib),
            "CUDA_DEVICE_MEMORY_LIMIT": "8g",
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"{state}.cache",
            "LIBCUDA_LOG_LEVEL": "0",
        }
    return {"LD_PRELOAD": str(lib), "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G", "MPSSHIM_REGION": f"{state}.region"}


def int_list(text: str, name: str, allowed: set[int] | None = None) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"--{name} {text!r}: expected comma-separated integers") from None
    if not values or any(v < 1 for v in values) or (allowed and any(v not in allowed for v in values)):
        raise SystemExit(
            f"--{name} {text!r}: expected comma-separated integers >= 1"
            + (f" among {sorted(allowed)}" if allowed else "")
        )
    return values


def run_shape(exe: Path, env: dict[str, str], shape: dict[str, Any], pairs: int, warmup: int) -> dict[str, Any]:
    """One run of a shape: its processes start their timed part together; returns the combined figures."""
    argv = [str(exe), shape["path"], str(shape["threads"]), str(pairs), str(shape["bytes"]), str(warmup), "wait"]
    procs = [
        subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(shape["procs"])
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"client did not start: {p.communicate(timeout=60)[1].strip()}")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    rows = []
    for p, (out, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"client exited {p.returncode}: {err.strip()}")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    total = sum(r["pairs"] for r in rows)
    refused = sum(r["refused"] for r in rows)
    if refused:
        raise RuntimeError(f"{refused} allocations were refused: the benchmark's cap is too small")
    wall = max(r["wall_end_ns"] for r in rows) - min(r["wall_start_ns"] for r in rows)
    calls = {
        name: sum(r["calls_per_pair"][name] * r["pairs"] for r in rows) / total for name in rows[0]["calls_per_pair"]
    }
    return {
        "wall_ns_per_pair": wall / total,
        "cpu_ns_per_pair": sum(r["cpu_ns"] for r in rows) / total,
        "calls_per_pair": calls,
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    walls = [r["wall_ns_per_pair"] for r in runs]
    return {
        "wall_ns_per_pair": statistics.median(walls),
        "wall_ns_per_pair_best": min(walls),
        "cpu_ns_per_pair": statistics.median(r["cpu_ns_per_pair"] for r in runs),
        "calls_per_pair": runs[-1]["calls_per_pair"],
        "runs": runs,
    }


def measure(
    args: argparse.Namespace,
    shims: dict[str, tuple[str, Path]],
    fake: Path | None,
    plain: Path,
    linked: Path,
    work: Path,
) -> list[dict[str, Any]]:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_PRELOAD", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "MPSSHIM_DISABLE", "MPSSHIM_REGION")
        and not k.startswith("CUDA_DEVICE_")
    }
    bare_env = base if fake is None else {**base, "LD_LIBRARY_PATH": str(fake), "FAKE_CUDA_DEVICES": "16G"}
    results = []
    shapes = itertools.product(args.paths, args.sizes, args.threads, args.procs)
    for n, (path, size, threads, nprocs) in enumerate(shapes):
        shape = {"path": path, "bytes": size, "threads": threads, "procs": nprocs}
        exe = linked if path == "link" else plain
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in ["bare", *shims]}
        for r in range(args.rounds):
            for label, done in runs.items():
                env = dict(bare_env)
                if label != "bare":
                    kind, lib = shims[label]
                    env.update(lib_env(kind, lib, work / f"{label}-{n}-{r}"))
                done.append(run_shape(exe, env, shape, args.pairs, args.warmup))
        bare = summarise(runs.pop("bare"))
        row: dict[str, Any] = {**shape, "bare": bare, "shims": {}}
        for label, rs in runs.items():
            s = summarise(rs)
            s["added_ns"] = s["wall_ns_per_pair"] - bare["wall_ns_per_pair"]
            s["ratio"] = s["wall_ns_per_pair"] / bare["wall_ns_per_pair"]
            s["added_cpu_ns"] = s["cpu_ns_per_pair"] - bare["cpu_ns_per_pair"]
            s["target_ns"] = TARGET_ONE if threads * nprocs == 1 else TARGET_MANY
            row["shims"][label] = s
        results.append(row)
        print(table_row(row, list(shims)), flush=True)
    return results


def header(labels: list[str]) -> str:
    cols = f"{'path':<6} {'bytes':>8} {'thr':>3} {'proc':>4} {'bare ns':>8} {'calls':>5}"
    for label in labels:
        cols += f" | {label[:14]:>14} {'added':>7} {'ratio':>5} {'calls':>5}"
    return cols


def table_row(row: dict[str, Any], labels: list[str]) -> str:
    bare = row["bare"]
    line = (
        f"{row['path']:<6} {row['bytes']:>8} {row['threads']:>3} {row['procs']:>4} "
        f"{bare['wall_ns_per_pair']:>8.1f} {sum(bare['calls_per_pair'].values()):>5.2f}"
    )
    for label in labels:
        s = row["shims"][label]
        mark = "!" if s["added_ns"] > s["target_ns"] else " "
        line += (
            f" | {s['wall_ns_per_pair']:>14.1f} {s['added_ns']:>6.1f}{mark} {s['ratio']:>5.2f} "
            f"{sum(s['calls_per_pair'].values()):>5.2f}"
        )
    return line


def markdown(report: dict[str, Any]) -> str:
    """The docs/benchmarks.md table: median ns per pair, added and ratio per shim."""
    labels = list(report["shims"])
    head = ["path", "bytes", "thr", "proc", "bare ns"] + [
        f"{label} {col}" for label in labels for col in ("ns", "added", "ratio")
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in report["results"]:
        cells = [
            row["path"],
            str(row["bytes"]),
            str(row["threads"]),
            str(row["procs"]),
            f"{row['bare']['wall_ns_per_pair']:.1f}",
        ]
        for label in labels:
            s = row["shims"][label]
            cells += [f"{s['wall_ns_per_pair']:.1f}", f"{s['added_ns']:.1f}", f"{s['ratio']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def flat_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per shape and library: what a summary table or a plot needs."""
    return [
        {
            **{k: row[k] for k in ("path", "bytes", "threads", "procs")},
            "shim": label,
            "bare_ns": round(row["bare"]["wall_ns_per_pair"], 1),
            "shim_ns": round(s["wall_ns_per_pair"], 1),
            "added_ns": round(s["added_ns"], 1),
            "ratio": round(s["ratio"], 3),
        }
        for row in results
        for label, s in row["shims"].items()
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shim",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="a libmpsshim.so to measure (repeat to compare); default: build this checkout's",
    )
    ap.add_argument(
        "--hami", action="append", default=[], metavar="LABEL=PATH", help="a HAMi-core libvgpu.so to measure beside"
    )
    ap.add_argument("--paths", default="link,dlsym,gpa", help="how the client reaches the driver")
    ap.add_argument("--sizes", default="4096,1048576", help="allocation sizes in bytes")
    ap.add_argument("--threads", default="1,8", help="threads per process")
    ap.add_argument("--procs", default="1,2", help="processes sharing one region (1 to 4)")
    ap.add_argument("--pairs", type=int, default=200_000, help="timed pairs per thread per run (default 200000)")
    ap.add_argument("--rounds", type=int, default=5, help="runs per shape and library (default 5)")
    ap.add_argument("--warmup", type=int, default=2000, help="untimed pairs per thread first (default 2000)")
    ap.add_argument("--json", type=Path, help="write every figure and run here")
    ap.add_argument("--markdown", type=Path, help="write the table for docs/benchmarks.md here")
    ap.add_argument("--driver", choices=("fake", "real"), default="fake", help="fake (tests/fakes) or this machine's")
    args = ap.parse_args(argv)
    paths = args.paths.split(",")
    if not paths or any(p not in ("link", "dlsym", "gpa") for p in paths):
        raise SystemExit(f"--paths {args.paths!r}: expected a comma-separated subset of link,dlsym,gpa")
    args.paths = paths
    args.sizes = int_list(args.sizes, "sizes")
    args.threads = int_list(args.threads, "threads")
    args.procs = int_list(args.procs, "procs", {1, 2, 3, 4})
    if args.pairs < 1 or args.rounds < 1 or args.warmup < 0:
        raise SystemExit("--pairs and --rounds must be >= 1, --warmup >= 0")
    shims = parse_libs(args.shim, args.hami)
    with tempfile.TemporaryDirectory(prefix="shim-bench-") as tmp:
        work = Path(tmp)
        fake, plain, linked, own = build(work, want_shim=not shims, driver=args.driver)
        if own is not None:
            shims = {"shim": ("shim", own)}
        load = os.getloadavg()
        print(
            f"alloc+free pairs against the {args.driver} driver, {args.pairs} per thread per run, "
            f"median of {args.rounds} runs; "
            f"{os.cpu_count()} cores, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
        )
        print(header(list(shims)))
        results = measure(args, shims, fake, plain, linked, work)
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "cpus": os.cpu_count(),
            "load_before": list(load),
            "load_after": list(os.getloadavg()),
            "platform": platform.platform(),
        },
        "driver": args.driver,
        "settings": {"pairs_per_thread": args.pairs, "rounds": args.rounds, "warmup_per_thread": args.warmup},
        "targets_ns_added": {"single_thread": TARGET_ONE, "threads": TARGET_MANY},
        "shims": {label: str(path) for label, (_, path) in shims.items()},
        "results": results,
        "rows": flat_rows(results),
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
