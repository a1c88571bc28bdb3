"""Checks that only real hardware can make: a real NVIDIA driver, GPU, MPS daemon and PyTorch.

Every test here is marked `gpu` and skipped where `nvidia-smi -L` lists no GPU. They never
change the card's settings (no compute-mode or MIG change, no reset), use a private pipe
directory, and stop every MPS daemon they start.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest


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
