"""scripts/demo.sh, run as a user runs it (simulated GPU, real control daemon, the current
shim and this interpreter's mpsd), checked for the lines that show what mpsd is for."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
G = 1 << 30

pytestmark = [pytest.mark.mps_binary, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo(shim_lib: Path) -> str:
    env = dict(os.environ, MPSD_DEMO_SIMULATE="1", MPSD_DEMO_PORT=str(free_port()), MPSD_DEMO_PYTHON=sys.executable)
    env["MPSSHIM_LIBRARY"] = str(shim_lib)  # the shim built from csrc/ now, not a stale copy
    for key in ("LD_PRELOAD", "LD_LIBRARY_PATH", "MPSSHIM_REGION", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
        env.pop(key, None)
    began = time.monotonic()
    proc = subprocess.run(
        [str(REPO / "scripts/demo.sh")], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    took = time.monotonic() - began
    assert proc.returncode == 0, f"demo.sh exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert took < 60, f"the demo took {took:.0f}s; it promises under a minute"
    return proc.stdout + proc.stderr


def test_the_demo_says_it_is_a_simulation(demo: str) -> None:
    assert demo.startswith("=== SIMULATION: no NVIDIA GPU here.")
    assert "gpu 0: Simulated GPU" in demo
    assert "daemon: up" in demo and "\nservers: none\n" in demo and "\nclients: none\n" in demo
    assert "defaults NOT as configured" not in demo  # status is asked with the run's defaults


def test_the_first_client_sees_the_slice_and_holds_3_gib(demo: str) -> None:
    a = [line.split("] ", 1)[1] for line in demo.splitlines() if line.startswith("[A pid ")]
    assert a == [
        "cuMemGetInfo: total 4.00 GiB, free 4.00 GiB",
        "cuMemAlloc 3.00 GiB: ok",
        "cuMemGetInfo: total 4.00 GiB, free 1.00 GiB",
        "holding",
    ]


def test_the_second_client_is_refused_with_the_shims_one_line(demo: str) -> None:
    b = [line.split("] ", 1)[1] for line in demo.splitlines() if line.startswith("[B pid ")]
    assert b == [
        "cuMemGetInfo: total 4.00 GiB, free 1.00 GiB",
        "cuMemAlloc 2.00 GiB: refused, CUDA_ERROR_OUT_OF_MEMORY (2)",
    ]
    refusals = [line for line in demo.splitlines() if line.startswith("mpsshim[")]
    assert len(refusals) == 1
    assert re.fullmatch(
        rf"mpsshim\[\d+\]: warn: cuMemAlloc_v2 refused with CUDA_ERROR_OUT_OF_MEMORY: device 0 cap {4 * G} bytes, "
        rf"in use {3 * G}, requested {2 * G} \(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT\)",
        refusals[0],
    ), refusals[0]
    assert "(B exited 3: its allocation would pass the slice's cap)" in demo


def test_the_usage_table_lists_the_holder(demo: str) -> None:
    holder = re.search(r"^\[A pid (\d+)\]", demo, re.MULTILINE).group(1)
    table = demo.split("--- python -m shim usage ", 1)[1].split("\n--- ", 1)[0].splitlines()[1:]
    assert table[0].split() == ["DEVICE", "CAP", "USED", "FREE", "PROCESSES"]
    assert table[1].split() == ["0", "4.0", "GiB", "3.0", "GiB", "1.0", "GiB", "1", "(1", "alive)"]
    assert table[2].split() == ["pid", holder, "alive", "3.0", "GiB"]


def test_metrics_show_the_region_and_its_client(demo: str) -> None:
    holder = re.search(r"^\[A pid (\d+)\]", demo, re.MULTILINE).group(1)
    lines = demo.splitlines()
    assert 'mpsd_region_memory_cap_bytes{device="0",region="demo"} 4.294967296e+09' in lines
    assert 'mpsd_region_memory_used_bytes{device="0",region="demo"} 3.221225472e+09' in lines
    assert f'mpsd_region_process_memory_bytes{{device="0",pid="{holder}",region="demo"}} 3.221225472e+09' in lines
    assert "mpsd_daemon_up 1.0" in lines


def test_the_demo_ends_cleanly(demo: str) -> None:
    assert demo.rstrip().endswith("mpsd exited 0; control daemon left running: no")
    assert "Traceback" not in demo and "WARNING" not in demo
