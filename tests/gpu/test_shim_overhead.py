"""The shim's own cost per cuMemAlloc_v2 + cuMemFree_v2 pair against the real driver: the same
benchmark as on the fake driver (benchmarks/shim_alloc.py), both ways a framework reaches the
driver (dlopen+dlsym, cuGetProcAddress), 4 KiB and 1 MiB, 1 and 8 threads, one process or two
sharing a region."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_shim_overhead_against_the_real_driver(tmp_path, record):
    out_json = tmp_path / "shim.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "shim_alloc.py"),
        "--driver",
        "real",
        "--pairs",
        "2000",
        "--rounds",
        "2",
        "--warmup",
        "200",
        "--paths",
        "dlsym,gpa",
        "--json",
        str(out_json),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110)  # under gpu-check's 120 s per test
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out_json.read_text())
    record(**result)
    assert len(result["rows"]) == 2 * 2 * 2 * 2  # paths x sizes x threads x processes
    for row in result["rows"]:
        assert row["bare_ns"] > 0 and row["shim_ns"] > 0
        # a real allocation costs microseconds; the shim's bookkeeping must stay well under one
        assert row["added_ns"] < 1000, row
