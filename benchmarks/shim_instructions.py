"""Instructions the shim adds to a cuMemAlloc_v2 + cuMemFree_v2 pair, counted by callgrind.

    .venv/bin/python benchmarks/shim_instructions.py [--shim LABEL=PATH]... [--hami LABEL=PATH]...
        [--paths link,dlsym,gpa] [--pairs N] [--top K] [--json FILE]

Instruction counts are deterministic: the same on any machine, whatever else runs on it. For each
path (how the client benchmarks/shim_alloc.c reaches the fake driver of tests/fakes: `link`,
`dlsym` on a `dlopen` handle, `gpa` = cuGetProcAddress_v2) and each library, the client runs
one thread under `valgrind --tool=callgrind` four times: bare and under the library, N and 2N
timed pairs each (after the same warm-up). The 2N run minus the N run is the cost of N pairs
(start-up, warm-up and exit cancel); minus the same difference bare, it is what the library
adds. Figures: instructions added per pair, the bare pair's own, and the per-function profile
of what was added (self instructions per pair by function, the same differencing per function;
functions of the fake driver and libc that the library calls count where they are spent).

--shim is a libmpsshim.so (cap 8 GiB on a 16 GiB fake device, never reached, so every pair takes
the whole charging path; a fresh region per run); without --shim or --hami this checkout's shim
is built and labelled `shim`. --hami is a HAMi-core libvgpu.so, run with its own settings
(CUDA_DEVICE_MEMORY_LIMIT=8g, a fresh CUDA_DEVICE_MEMORY_SHARED_CACHE per run): see
benchmarks/hami_core.sh for building one against the fake driver.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shim_alloc import build, lib_env, parse_libs  # noqa: E402

PATHS = ("link", "dlsym", "gpa")


def callgrind(exe: Path, env: dict[str, str], path: str, pairs: int, warmup: int, out: Path) -> None:
    cmd = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--compress-strings=no",
        "--compress-pos=no", str(exe), path, "1", str(pairs), "4096", str(warmup),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["refused"]:
        raise SystemExit(f"{result['refused']} allocations were refused under callgrind: {cmd}")


def self_costs(out: Path) -> tuple[int, dict[str, int]]:
    """Total Ir and self Ir per function ("function [object]") of a callgrind output file written
    with --compress-strings=no --compress-pos=no."""
    costs: dict[str, int] = collections.defaultdict(int)
    obj = fn = ""
    total = 0
    skip_next = False
    for line in out.read_text(errors="replace").splitlines():
        if skip_next:  # the inclusive cost of a call, counted in the callee's own lines
            skip_next = False
            continue
        if line.startswith("ob="):
            obj = Path(line[3:]).name
        elif line.startswith("fn="):
            fn = line[3:]
        elif line.startswith("calls="):
            skip_next = True
        elif line.startswith(("summary:", "totals:")):
            total = int(line.split()[1])
        elif line[:1].isdigit():
            fields = line.split()
            if len(fields) >= 2:
                costs[f"{fn} [{obj}]"] += int(fields[1])
    return total, dict(costs)


def per_pair(
    small: tuple[int, dict[str, int]], large: tuple[int, dict[str, int]], pairs: int
) -> tuple[float, dict[str, float]]:
    fns = set(small[1]) | set(large[1])
    return (large[0] - small[0]) / pairs, {f: (large[1].get(f, 0) - small[1].get(f, 0)) / pairs for f in fns}


def measure_path(
    path: str,
    libs: dict[str, tuple[str, Path]],
    exe: Path,
    base_env: dict[str, str],
    args: argparse.Namespace,
    work: Path,
) -> dict[str, Any]:
    counted: dict[str, tuple[float, dict[str, float]]] = {}
    for label in ["bare", *libs]:
        runs = []
        for n, pairs in enumerate((args.pairs, 2 * args.pairs)):
            env = dict(base_env)
            if label != "bare":
                kind, lib = libs[label]
                env.update(lib_env(kind, lib, work / f"{label}-{path}-{n}"))
            out = work / f"{label}-{path}-{n}.callgrind"
            callgrind(exe, env, path, pairs, args.warmup, out)
            runs.append(self_costs(out))
        counted[label] = per_pair(runs[0], runs[1], args.pairs)
    bare_total, bare_fns = counted.pop("bare")
    row: dict[str, Any] = {"path": path, "bare_per_pair": bare_total, "libs": {}}
    for label, (total, fns) in counted.items():
        added = {f: fns.get(f, 0.0) - bare_fns.get(f, 0.0) for f in set(fns) | set(bare_fns)}
        profile = sorted(((round(v, 2), f) for f, v in added.items() if abs(v) >= 0.5), reverse=True)
        row["libs"][label] = {
            "per_pair": total,
            "added_per_pair": total - bare_total,
            "profile": [{"function": f, "added_per_pair": v} for v, f in profile],
        }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shim", action="append", default=[], metavar="LABEL=PATH", help="a libmpsshim.so")
    ap.add_argument("--hami", action="append", default=[], metavar="LABEL=PATH", help="a HAMi-core libvgpu.so")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--pairs", type=int, default=20000, help="N (the runs make N and 2N pairs)")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--top", type=int, default=15, help="functions shown per profile")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    paths = args.paths.split(",")
    if not paths or any(p not in PATHS for p in paths):
        raise SystemExit(f"--paths {args.paths!r}: expected comma-separated names among {','.join(PATHS)}")
    if args.pairs < 100 or args.warmup < 0:
        raise SystemExit(f"--pairs {args.pairs} / --warmup {args.warmup}: expected --pairs >= 100, --warmup >= 0")
    libs = parse_libs(args.shim, args.hami)
    with tempfile.TemporaryDirectory(prefix="shim-instr-") as tmp:
        work = Path(tmp)
        fake, plain, linked, built = build(work, want_shim=not libs)
        if built is not None:
            libs = {"shim": ("shim", built)}
        assert fake is not None
        base_env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        base_env.update(LD_LIBRARY_PATH=str(fake), FAKE_CUDA_DEVICES="16G")
        rows = []
        for path in paths:
            row = measure_path(path, libs, linked if path == "link" else plain, base_env, args, work)
            rows.append(row)
            print(f"{path}: bare pair {row['bare_per_pair']:.1f} instructions", flush=True)
            for label, s in row["libs"].items():
                print(f"  {label}: {s['added_per_pair']:.1f} added per pair ({s['per_pair']:.1f} in all)")
                for item in s["profile"][: args.top]:
                    print(f"    {item['added_per_pair']:>8.1f}  {item['function']}")
    report = {
        "pairs": args.pairs,
        "warmup": args.warmup,
        "libs": {k: str(v[1]) for k, v in libs.items()},
        "results": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
