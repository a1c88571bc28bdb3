"""Two processes of one framework sharing a cap (issue 21, defect 8): a framework that
preallocates at start (JAX 75% of the total, TensorFlow nearly all the free memory) takes the
whole shared slice in the first process, and the second's allocations are refused. Wherever
processes share a cap, mpsd gives them the variables that make those frameworks allocate on
demand (mpsd.alloc.frameworks, one source for every face). Here: two `mpsd exec --region` of the
stand-in framework (tests/e2e/preallocator.py, over the fake driver, under the real shim)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shim import framework_env

REPO = Path(__file__).resolve().parents[2]
M = 1 << 20


def start(framework: str, hold_mib: int, region: Path, shim_lib: Path, fake: Path, **own: str) -> subprocess.Popen:
    """`mpsd exec` of the stand-in framework in ``region`` (a 1 GiB cap on device 0); ``own``:
    variables the user set in the environment mpsd exec runs in."""
    env = {k: v for k, v in os.environ.items() if k not in framework_env() and not k.startswith("CUDA_MPS")}
    env.update(LD_LIBRARY_PATH=str(fake), FAKE_CUDA_DEVICES="16G", PYTHONPATH=str(REPO), **own)
    env.pop("LD_PRELOAD", None)
    argv = [sys.executable, "-m", "mpsd", "exec", f"--state-dir={region.parent / 'state'}",
            f"--shim-library={shim_lib}", "--region", str(region), "--gpu-memory", "1G", "--",
            sys.executable, "-m", "tests.e2e.preallocator", framework, str(hold_mib)]
    return subprocess.Popen(argv, env=env, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def first_line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, f"no output, exit {proc.wait(30)}"
    return json.loads(line)


def release(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.communicate("\n", timeout=60)


@pytest.mark.parametrize("framework", ["jax", "tensorflow"])
def test_two_processes_of_one_framework_share_a_cap(framework, shim_lib, fake_cuda_dir, tmp_path):
    region = tmp_path / "region"
    first = start(framework, 100, region, shim_lib, fake_cuda_dir)
    second = None
    try:
        assert first_line(first) == {"framework": framework, "preallocated": 0, "held": 100 * M}
        second = start(framework, 300, region, shim_lib, fake_cuda_dir)
        assert first_line(second) == {"framework": framework, "preallocated": 0, "held": 300 * M}
    finally:
        release(first, *([second] if second else []))
    assert first.returncode == 0 and second.returncode == 0


@pytest.mark.parametrize(
    "framework, own, preallocated",
    [
        ("jax", {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, 768 * M),  # 75% of the 1 GiB cap
        ("tensorflow", {"TF_FORCE_GPU_ALLOW_GROWTH": "false"}, 799 * M),  # 1 GiB free less 225 MiB
    ],
)
def test_what_the_variables_prevent_and_that_a_users_own_value_wins(
    framework, own, preallocated, shim_lib, fake_cuda_dir, tmp_path
):
    # The user asked for preallocation: mpsd exec keeps it, and the first process takes the
    # slice, as the real frameworks were seen to: the second's 300 MiB is refused.
    region = tmp_path / "region"
    first = start(framework, 100, region, shim_lib, fake_cuda_dir, **own)
    try:
        assert first_line(first) == {"framework": framework, "preallocated": preallocated, "held": 100 * M}
        second = start(framework, 300, region, shim_lib, fake_cuda_dir, **own)
        refused = first_line(second)
        assert second.wait(60) == 3 and "oom" in refused
    finally:
        release(first)
