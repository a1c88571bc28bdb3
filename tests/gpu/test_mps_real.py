"""The real MPS daemon, supervised by `mpsd run`, serving real PyTorch clients.

Uses the driver's own nvidia-cuda-mps-control and a private pipe directory; never changes
the compute mode. The daemon is stopped through mpsd (SIGTERM) before each test ends.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gpu.conftest import clean_env

GIB = 1 << 30
MPSD = [sys.executable, "-m", "mpsd"]


def _mps_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-a", "nvidia-cuda-mps"], capture_output=True, text=True)
    return out.stdout.splitlines()


@pytest.fixture
def node(tmp_path: Path):
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("the driver's nvidia-cuda-mps-control is not on PATH")
    pipe, logs = tmp_path / "pipe", tmp_path / "log"
    args = ["--control-binary", control, "--pipe-dir", str(pipe), "--log-dir", str(logs),
            "--metrics-address", "", "--state-dir", str(tmp_path / "state"),
            "--active-thread-percentage", "100", "--health-interval", "1s"]
    proc = subprocess.Popen([*MPSD, "run", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = subprocess.run([*MPSD, "status", "--json", "--pipe-dir", str(pipe)], capture_output=True, text=True)
        if status.returncode == 0:
            break
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"mpsd run did not come up:\n{proc.stdout.read() if proc.stdout else ''}")
    yield {"pipe": pipe, "logs": logs, "args": args, "proc": proc}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert not [p for p in _mps_processes() if str(pipe) in p], "an MPS daemon outlived mpsd"


def _exec(node, *mpsd_args: str, code: str, python: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MPSD, "exec", "--pipe-dir", str(node["pipe"]), *mpsd_args, "--", python, "-c", code],
        env=clean_env(), capture_output=True, text=True, timeout=300,
    )


def test_client_runs_through_the_mps_server(node, torch_python):
    code = "import torch; a = torch.randn(2048, 2048, device='cuda'); print(float((a @ a).sum()) != 0.0)"
    out = _exec(node, "--gpu-compute", "50", code=code, python=torch_python)
    assert out.returncode == 0 and "True" in out.stdout, out.stderr
    control_log = (node["logs"] / "control.log").read_text()
    assert "Starting new server" in control_log or "New client" in control_log, control_log[-2000:]


def test_mps_server_enforces_the_pinned_limit_without_the_shim(node, torch_python):
    code = (
        "import sys, torch\n"
        "try:\n    torch.empty(3 << 30, dtype=torch.uint8, device='cuda')\n"
        "except torch.OutOfMemoryError:\n    sys.exit(3)\n"
    )
    out = _exec(node, "--gpu-memory", "2G", "--no-shim", code=code, python=torch_python)
    assert out.returncode == 3, out.stdout + out.stderr


def test_shim_and_mps_together_show_the_cap(node, torch_python):
    code = "import torch; print(torch.cuda.mem_get_info()[1])"
    out = _exec(node, "--gpu-memory", "2G", code=code, python=torch_python)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == 2 * GIB


def test_status_lists_the_server_and_its_client(node, torch_python, tmp_path):
    code = "import os, sys, torch; x = torch.empty(1 << 28, device='cuda'); print(os.getpid(), flush=True); sys.stdin.read()"
    client = subprocess.Popen(
        [*MPSD, "exec", "--pipe-dir", str(node["pipe"]), "--", torch_python, "-c", code],
        env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = client.stdout.readline().strip()
        assert line.isdigit(), client.stderr.read()
        status = subprocess.run([*MPSD, "status", "--json", "--pipe-dir", str(node["pipe"])],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        data = json.loads(status.stdout)
        assert data["daemon"] == "up" and len(data["servers"]) == 1, data
        assert int(line) in [c["pid"] for c in data["clients"]], data
    finally:
        client.stdin.close()
        client.wait(timeout=120)
