"""benchmarks/shim_instructions.py stays runnable: a tiny callgrind run on two paths (structure
only; the figures belong to docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import REPO

BENCH = REPO / "benchmarks" / "shim_instructions.py"


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600, check=False)


def test_the_added_instructions_and_their_profile_are_reported_per_path(shim_lib: Path, tmp_path: Path) -> None:
    out = tmp_path / "instr.json"
    proc = run_bench(
        "--shim", f"mine={shim_lib}", "--paths", "dlsym,gpa", "--pairs", "200", "--warmup", "20", "--json", str(out)
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["libs"] == {"mine": str(shim_lib)} and report["pairs"] == 200
    assert [row["path"] for row in report["results"]] == ["dlsym", "gpa"]
    for row in report["results"]:
        mine = row["libs"]["mine"]
        assert row["bare_per_pair"] > 0 and mine["added_per_pair"] > 0
        assert mine["per_pair"] == row["bare_per_pair"] + mine["added_per_pair"]
        # the hooks themselves are where the shim's instructions go, and the profile accounts for
        # what was added (functions under half an instruction per pair are left out)
        functions = {item["function"].split(" [")[0] for item in mine["profile"]}
        assert {"cuMemAlloc_v2", "cuMemFree_v2"} <= functions, functions
        assert abs(sum(item["added_per_pair"] for item in mine["profile"]) - mine["added_per_pair"]) < 5
    assert "dlsym: bare pair" in proc.stdout and "mine:" in proc.stdout


def test_bad_arguments_are_refused_with_one_line(tmp_path: Path) -> None:
    for args, words in [
        (["--paths", "link,ctypes"], "link,dlsym,gpa"),
        (["--pairs", "10"], "--pairs >= 100"),
        (["--shim", f"a={tmp_path / 'missing.so'}"], "is not a file"),
        (["--hami", "nolabel"], "LABEL=PATH"),
    ]:
        proc = run_bench(*args)
        assert proc.returncode != 0
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
