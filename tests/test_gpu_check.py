"""scripts/gpu-check.sh without a GPU: its CPU dry-run against the fake driver, in CI.

The script runs for real (a venv over this interpreter's packages, mpsd installed from the tree,
tests/gpu under pytest, the shim measured against tests/fakes' libcuda.so.1, the inference
benchmark on the CPU with the real nvidia-cuda-mps-control under `mpsd run`), and the results
folder it leaves is checked. A second test interrupts it while the MPS daemon runs and checks that
no MPS process it started is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from benchmarks.gpu_check import mps_pids_under
from tests.gpu.conftest import GPUS
from tests.mpsbin import FetchError, ensure_mps_control

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu-check.sh"


@pytest.fixture(scope="module")
def control() -> Path:
    try:
        return ensure_mps_control()
    except FetchError as exc:
        pytest.skip(f"the real nvidia-cuda-mps-control could not be fetched: {str(exc).splitlines()[0]}")


@pytest.fixture
def scratch():
    """The script's TMPDIR, so leftovers can be looked for there; short, because the MPS pipe dir
    lies under it and a unix socket path has at most 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="gc", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_MPS_", "MPSSHIM_")) and k != "LD_PRELOAD"}
    env.pop("OUT", None)
    env["TMPDIR"] = str(scratch)
    return env


def _args(tmp: Path, control: Path) -> list[str]:
    return [
        str(SCRIPT),
        "--dry-run",
        "--python",
        sys.executable,
        "--venv",
        str(tmp / "venv"),
        "--out",
        str(tmp / "out"),
        "--control-binary",
        str(control),
    ]


def _gpu_test_count() -> int:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return sum(1 for line in proc.stdout.splitlines() if "::" in line)


def test_dry_run_writes_the_results_folder(tmp_path, scratch, control):
    start = time.monotonic()
    proc = subprocess.run(
        _args(tmp_path, control), cwd=REPO, env=_env(scratch), capture_output=True, text=True, timeout=180, check=False
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if GPUS == 0:
        lines = [line for line in proc.stdout.splitlines() if "no NVIDIA GPU here" in line]
        assert len(lines) == 1, proc.stdout
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    assert {
        "schema",
        "dry_run",
        "mode",
        "command",
        "commit",
        "started",
        "finished",
        "install",
        "facts",
        "machine",
        "steps",
        "tests",
        "records",
        "benchmarks",
        "plots",
    } <= results.keys()
    assert results["dry_run"] is True and results["mode"] == "dry-run"
    assert {n: s["status"] for n, s in results["steps"].items()} == dict.fromkeys(
        ("facts", "pytest", "shim_alloc", "inference"), "ok"
    )
    # facts came through the fake NVML, and the control binary's version was read
    assert results["facts"]["nvml"]["devices"][0]["name"] == "Fake GPU (gpu-check dry-run)"
    assert results["facts"]["mps"]["control_versions"], results["facts"]["mps"]
    # every test of tests/gpu is in the JUnit report; without a GPU each one is skipped with its reason
    assert (out / "pytest-gpu.xml").is_file()
    tests = results["tests"]
    assert tests["total"] == _gpu_test_count() > 0
    if GPUS == 0:
        assert tests["skipped"] == tests["total"], tests
        assert all("no NVIDIA GPU" in c["message"] for c in tests["cases"]), tests["cases"]
    shim = results["benchmarks"]["shim_alloc"]
    assert shim["driver"] == "fake" and len(shim["rows"]) == 4  # dlsym x 2 sizes x 2 thread counts
    assert all(r["bare_ns"] > 0 and r["shim_ns"] > 0 for r in shim["rows"])
    inference = results["benchmarks"]["inference"]
    assert inference["dry_run"] is True and inference["device"] == "cpu"
    modes = {(r["model"], r["mode"], r["clients"]) for r in inference["rows"]}
    for model in ("resnet18", "encoder"):
        for mode in ("sequential", "timeslice", "mps"):
            assert {(model, mode, 1), (model, mode, 2)} <= modes, (model, mode, sorted(modes))
    assert all(c["items_per_s"] > 0 for r in inference["rows"] for c in r["per_client"])
    assert inference["split"]["model"] == "resnet18" and inference["split"]["ratio"] > 0
    summary = (out / "summary.md").read_text()
    assert "DRY RUN" in summary and "## tests/gpu" in summary and "## Inference" in summary
    assert not mps_pids_under(scratch), "an MPS daemon outlived gpu-check.sh"
    assert not list(scratch.glob("gpu-check.*")), "the scratch directory was left behind"
    print(f"gpu-check.sh dry-run took {elapsed:.1f}s")


def test_interrupted_dry_run_leaves_no_mps_process(tmp_path, scratch, control):
    proc = subprocess.Popen(
        _args(tmp_path, control),
        cwd=REPO,
        env=_env(scratch),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not mps_pids_under(scratch):
            assert proc.poll() is None and time.monotonic() < deadline, "no MPS daemon was seen running"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C does: the whole foreground group
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    log = proc.stdout.read()[-3000:]
    time.sleep(3)  # an orphaned step would go on starting clients and daemons
    daemons, left = mps_pids_under(scratch), _processes_naming(tmp_path, scratch)
    for pid in [*daemons, *(int(line.split(":")[0]) for line in left)]:  # only this test's own processes
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not daemons, log
    assert not left, log


def _processes_naming(*paths: Path) -> list[str]:
    """Command lines of live processes that name one of ``paths`` (the script's own children do)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(str(p) in cmdline for p in paths):
                found.append(f"{entry.name}: {cmdline}")
    return found


# ---- the pure parts: formats and arithmetic


def test_percentile_is_nearest_rank():
    from benchmarks.inference_client import percentile

    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    assert percentile([7.0], 99) == 7.0


def test_sequential_turns_take_one_window_and_do_not_overlap():
    from benchmarks.inference import MIN_SLOT, mode_plan

    plan = mode_plan("sequential", 4, 8, start=100.0, duration=2.0, gap=0.5)
    slots = [(cmd["start_at"], cmd["start_at"] + cmd["duration"]) for _, cmd in plan]
    assert [i for i, _ in plan] == [0, 1, 2, 3]
    assert sum(b - a for a, b in slots) == pytest.approx(2.0)
    assert all(slots[i][1] < slots[i + 1][0] for i in range(3))
    assert mode_plan("sequential", 100, 1, 0.0, 1.0, 0.0)[0][1]["duration"] == MIN_SLOT
    shared = mode_plan("timeslice", 3, 1, 5.0, 1.0, 0.5)
    assert {(c["start_at"], c["duration"]) for _, c in shared} == {(5.0, 1.0)}


def test_aggregate_and_targets():
    from benchmarks.inference import aggregate, verdicts

    def client(requests, seconds):
        return {
            "requests": requests,
            "batch": 2,
            "seconds": seconds,
            "engine": "torch",
            "pid": 1,
            "items_per_s": requests * 2 / seconds,
            "p50_ms": 1.0,
            "p99_ms": 2.0,
            "peak_memory": 0,
            "late_start_s": 0.0,
        }

    seq = aggregate("sequential", 2, [client(10, 0.5), client(10, 0.5)], gap=0.5)
    assert seq["aggregate_items_per_s"] == pytest.approx(40.0)  # 40 items over 1 s of turns
    ts = aggregate("timeslice", 2, [client(10, 1.0), client(10, 0.9)], gap=0.5)
    assert ts["aggregate_items_per_s"] == pytest.approx(40.0)  # 40 items over the longest client
    rows = [
        {"model": "m", "batch": 1, "mode": mode, "clients": n, "aggregate_items_per_s": v}
        for mode, n, v in (
            ("timeslice", 4, 100.0),
            ("mps", 4, 150.0),
            ("timeslice", 8, 100.0),
            ("mps", 8, 149.0),
            ("mps", 2, 500.0),
        )
    ]
    got = {(t["clients"], t["met"]) for t in verdicts(rows)}
    assert got == {(4, True), (8, False)}


def test_control_binary_version_against_the_driver(tmp_path):
    from benchmarks.gpu_facts import binary_versions, version_match

    binary = tmp_path / "ctl"
    binary.write_bytes(b"\x7fELF\0junk 1.2.3 535.261.03\0more 12.0\0")
    assert binary_versions(binary) == ["535.261.03"]
    assert version_match("535.261.03", ["535.261.03"]) is True
    assert version_match("580.159.04", ["535.261.03"]) is False
    assert version_match(None, ["535.261.03"]) is None and version_match("580.1", []) is None


def test_junit_report_is_read(tmp_path):
    from benchmarks.gpu_report import read_junit, render_summary

    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.a" name="test_ok" time="1.5"/>'
        '<testcase classname="tests.gpu.a" name="test_bad" time="0.1"><failure message="assert 1 == 2">tb</failure>'
        '</testcase><testcase classname="tests.gpu.b" name="test_skip" time="0">'
        '<skipped message="no NVIDIA GPU here"/></testcase></testsuite></testsuites>'
    )
    report = read_junit(xml)
    assert (report["total"], report["passed"], report["failed"], report["skipped"]) == (3, 1, 1, 1)
    assert report["cases"][1] == {
        "name": "tests.gpu.a::test_bad",
        "outcome": "failed",
        "seconds": 0.1,
        "message": "assert 1 == 2",
    }
    assert read_junit(tmp_path / "missing.xml")["total"] == 0
    summary = render_summary({"dry_run": False, "tests": report, "steps": {}, "machine": ["GPU: X"]})
    assert "DRY RUN" not in summary and "3 tests: 1 passed, 1 failed" in summary and "GPU: X" in summary


def test_inference_budget_skips_what_it_cannot_start(tmp_path):
    out = tmp_path / "inf.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/inference.py", "--dry-run", "--budget", "0", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["rows"] == [] and result["split"] is None
    assert result["skipped"] == [
        "resnet18: skipped, the 0s budget was spent",
        "encoder: skipped, the 0s budget was spent",
    ]
