"""The shim's own cost per cuMemAlloc_v2 + cuMemFree_v2 pair against the real driver."""

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
        str(REPO / "benchmarks" / "gpu_shim_alloc.py"),
        "--driver",
        "real",
        "--pairs",
        "3000",
        "--rounds",
        "3",
        "--threads",
        "1,8",
        "--sizes",
        "4096,1048576",
        "--json",
        str(out_json),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out_json.read_text())
    record(**result)
    assert len(result["rows"]) == 4
    for row in result["rows"]:
        assert row["bare_ns"] > 0 and row["shim_ns"] > 0
        # a real allocation costs microseconds; the shim's bookkeeping must stay well under one
        assert row["added_ns"] < 1000, row
