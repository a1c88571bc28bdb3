"""Checks that only real hardware can make: a real NVIDIA driver, GPU, MPS daemon and PyTorch.

Every test here is marked `gpu` and skipped where `nvidia-smi -L` lists no GPU. They never
change the card's settings (no compute-mode or MIG change, no reset), use a private pipe
directory, and stop every MPS daemon they start. Each client runs in a subprocess with a clean
environment (`clean_env`).

Fixtures: `torch_python` (a Python whose torch sees the GPU), `python_with(module)` (skip unless
that module imports), `record(**figures)` (what a test measured, written to
$GPU_CHECK_RECORDS/<test>.json for scripts/gpu-check.sh's results, and printed), `node` (`mpsd
run` with the driver's real control daemon on a private pipe dir, stopped with SIGTERM after the
test, which then checks that no MPS process of that pipe dir is left).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

MPSD = [sys.executable, "-m", "mpsd"]


def _gpu_count() -> int:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


GPUS = _gpu_count()


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any MPS or shim setting of its own, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_MPS_", "MPSSHIM_"))}
    env.update(extra)
    return env


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no NVIDIA GPU here (nvidia-smi -L lists none)")
    for item in items:
        if item.path.is_relative_to(config.rootpath / "tests" / "gpu"):
            item.add_marker(pytest.mark.gpu)
            if GPUS == 0:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def torch_python() -> str:
    """A Python that imports torch with CUDA; the tests run it in subprocesses."""
    import sys

    probe = subprocess.run(
        [sys.executable, "-c", "import torch; assert torch.cuda.is_available(); print(torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        pytest.skip(f"PyTorch with CUDA is not importable: {probe.stderr.strip().splitlines()[-1:]}")
    return sys.executable


@pytest.fixture(scope="session")
def python_with():
    """python_with("cupy") -> sys.executable, or skip when the module does not import with a GPU."""
    seen: dict[str, str | None] = {}

    def check(module: str, probe: str = "") -> str:
        if module not in seen:
            code = f"import {module}\n{probe}"
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
            seen[module] = None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["failed"])[-1]
        if seen[module] is not None:
            pytest.skip(f"{module} is not usable here: {seen[module]}")
        return sys.executable

    return check


@pytest.fixture
def record(request):
    """record(**figures): keep what this test measured in the gpu-check results (and print it)."""
    directory = os.environ.get("GPU_CHECK_RECORDS")
    name = request.node.name
    figures: dict[str, object] = {}

    def add(**values: object) -> None:
        figures.update(values)
        print(f"record {name}: {values}")
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            (Path(directory) / f"{name}.json").write_text(json.dumps(figures, indent=1, default=str) + "\n")

    return add


def mps_processes(pipe: Path | None = None) -> list[int]:
    """PIDs of nvidia-cuda-mps-* processes, those serving ``pipe`` only when given."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "comm").read_text().startswith("nvidia-cuda-mps"):
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if pipe is None or f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() in environ:
            found.append(int(entry.name))
    return found


@pytest.fixture
def node(request):
    """`mpsd run` with the driver's nvidia-cuda-mps-control on a private (short) pipe dir."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("the driver's nvidia-cuda-mps-control is not on PATH")
    base = Path(tempfile_short())
    pipe, logs = base / "pipe", base / "log"
    common = [
        "--control-binary",
        control,
        "--pipe-dir",
        str(pipe),
        "--log-dir",
        str(logs),
        "--state-dir",
        str(base / "state"),
    ]
    args = [*common, "--metrics-address", "", "--active-thread-percentage", "100", "--health-interval", "1s"]
    log = (base / "mpsd-run.log").open("w")  # a file, not a pipe: nobody reads it while the test runs
    proc = subprocess.Popen([*MPSD, "run", *args], stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = subprocess.run([*MPSD, "status", "--json", *common], capture_output=True, text=True)
        if status.returncode == 0:
            break
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"mpsd run did not come up:\n{(base / 'mpsd-run.log').read_text()[-3000:]}")
    yield {
        "pipe": pipe,
        "logs": logs,
        "args": args,
        "common": common,
        "proc": proc,
        "control": control,
        "log": base / "mpsd-run.log",
    }
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while mps_processes(pipe) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = mps_processes(pipe)
    for pid in left:  # this test's own daemon and servers only
        os.kill(pid, signal.SIGKILL)
    log.close()
    keep = os.environ.get("GPU_CHECK_RECORDS")
    if keep:  # mpsd's and the daemon's logs go with the results
        for path in (base / "mpsd-run.log", logs / "control.log", logs / "server.log"):
            if path.is_file():
                Path(keep).mkdir(parents=True, exist_ok=True)
                shutil.copy(path, Path(keep) / f"{request.node.name}.{path.name}")
    shutil.rmtree(base, ignore_errors=True)
    assert not left, f"MPS processes {left} outlived mpsd"


def tempfile_short() -> str:
    """A new directory under /tmp (or gpu-check's scratch directory, whose trap then also quits
    its daemons): the pipe dir's socket path must stay under 108 bytes."""
    import tempfile

    return tempfile.mkdtemp(prefix="mpsd-gpu-", dir=os.environ.get("GPU_CHECK_WORK", "/tmp"))
