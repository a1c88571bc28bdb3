"""Fixtures for the sharing backends: the MPS v3 stand-in (tests/fakes/mps_control_v3.py) as an
``nvidia-cuda-mps-control`` on disk, and a running v3 daemon on a short pipe dir."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

from mpsd.daemon.control3 import Control3
from tests.fakes import install_fake_mps_v3
from mpsd.trees import remove_tree


@pytest.fixture(scope="session")
def fake_v3_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_fake_mps_v3(tmp_path_factory.mktemp("mpsv3"))


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="v3", dir="/tmp"))
    yield d
    remove_tree(str(d))


@dataclass
class V3Daemon:
    proc: subprocess.Popen
    control: Control3
    pipe: Path


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture
def start_v3(fake_v3_binary: Path, short_tmp: Path) -> Iterator[Callable[..., V3Daemon]]:
    """start_v3(toml_text, env=None) -> a running stand-in daemon (-f -p 3 -a <file>)."""
    procs: list[subprocess.Popen] = []

    def start(toml: str, env: dict | None = None, expect_exit: bool = False) -> V3Daemon:
        pipe = short_tmp / "pipe"
        config = short_tmp / "mps.toml"
        config.write_text(toml)
        full = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(short_tmp))
        full.update(env or {})
        proc = subprocess.Popen([str(fake_v3_binary), "-f", "-p", "3", "-a", str(config)], env=full,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        if not expect_exit:
            assert wait_for(lambda: (pipe / "control").exists() or proc.poll() is not None)
            assert proc.poll() is None, proc.communicate()
        return V3Daemon(proc, Control3(str(fake_v3_binary), str(pipe), timeout=10), pipe)

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


from tests.inventory.conftest import fake_nvml_lib  # noqa: E402,F401 (fixture: the fake NVML, for every test here)
