"""benchmarks/shim_alloc.py stays runnable: a tiny run of every shape against two shims (structure
only, no timing is asserted: timings belong to docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.shim.conftest import REPO

BENCH = REPO / "benchmarks" / "shim_alloc.py"


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300, check=False)


def test_every_shape_is_measured_bare_and_under_each_shim(shim_lib: Path, tmp_path: Path) -> None:
    out, table = tmp_path / "bench.json", tmp_path / "bench.md"
    proc = run_bench(
        "--shim",
        f"before={shim_lib}",
        "--shim",
        f"after={shim_lib}",
        "--pairs",
        "300",
        "--rounds",
        "1",
        "--warmup",
        "10",
        "--json",
        str(out),
        "--markdown",
        str(table),
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["shims"] == {"before": str(shim_lib), "after": str(shim_lib)}
    shapes = {(r["path"], r["bytes"], r["threads"], r["procs"]) for r in report["results"]}
    assert shapes == {
        (p, b, t, n) for p in ("link", "dlsym", "gpa") for b in (4096, 1 << 20) for t in (1, 8) for n in (1, 2)
    }
    for row in report["results"]:
        pairs = 300 * row["threads"] * row["procs"]
        for fig in [row["bare"], *row["shims"].values()]:
            assert fig["wall_ns_per_pair"] > 0 and fig["cpu_ns_per_pair"] > 0 and len(fig["runs"]) == 1
            # every pair reached the driver exactly once each way, whatever the path
            assert fig["calls_per_pair"]["cuMemAlloc_v2"] == 1 and fig["calls_per_pair"]["cuMemFree_v2"] == 1, fig
            assert fig["runs"][0]["wall_ns_per_pair"] * pairs > 0
        for label in ("before", "after"):
            s = row["shims"][label]
            assert s["added_ns"] == s["wall_ns_per_pair"] - row["bare"]["wall_ns_per_pair"]
            assert s["ratio"] == s["wall_ns_per_pair"] / row["bare"]["wall_ns_per_pair"]
            assert s["calls_per_pair"]["cuCtxGetDevice"] == 0  # one device: no lookup per allocation
            assert s["target_ns"] == (100 if row["threads"] * row["procs"] == 1 else 200)
    md = table.read_text().splitlines()
    assert md[0].startswith(
        "| path | bytes | thr | proc | bare ns | before ns | before added | before ratio | after ns"
    )
    assert len(md) == 2 + len(shapes) and all(line.count("|") == 12 for line in md)
    lines = proc.stdout.splitlines()
    assert "before" in lines[1] and "after" in lines[1] and len(lines) == 2 + len(shapes)


def test_bad_arguments_are_refused_with_one_line(tmp_path: Path) -> None:
    for args, words in [
        (["--shim", "nolabel"], "LABEL=PATH"),
        (["--shim", f"a={tmp_path / 'missing.so'}"], "is not a file"),
        (["--paths", "link,ctypes"], "link,dlsym,gpa"),
        (["--procs", "5"], "among [1, 2, 3, 4]"),
        (["--threads", "x"], "integers"),
    ]:
        proc = run_bench(*args)
        assert proc.returncode != 0
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
