"""MIG tests: instances as NVML would list them, daemons of the real control binary per instance."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from mpsd import config as cfg
from mpsd.inventory.mig import MigDevice
from tests.inventory.conftest import fake_nvml_lib, nvml_config  # noqa: F401 (fixtures: the fake NVML)
from tests.mpsfixtures import procs  # noqa: F401 (a fixture; mps_control comes from tests/conftest.py)

GIB, MIB = 1 << 30, 1 << 20
H100 = "NVIDIA H100 80GB HBM3"
PARENT = "GPU-00000000-0000-0000-0000-0000000000a0"


def mig(n: int, profile: str = "1g.10gb", gpu: int = 1, gi: int | None = None, memory: int = 9984 * MIB,
        sms: int = 16, slices: int = 1) -> MigDevice:
    """The n-th instance of a test: MIG-...000n on GPU ``gpu``."""
    return MigDevice(
        uuid=f"MIG-{n:08x}-1111-2222-3333-444444444444", parent_index=gpu, parent_uuid=PARENT, mig_index=n,
        gpu_instance=gi if gi is not None else n + 1, compute_instance=0, profile=profile,
        name=f"{H100} MIG {profile}", memory_total=memory, memory_used=0, sm_count=sms, gi_slices=slices,
        ci_slices=slices, compute_capability=(9, 0), parent_minor=gpu, caps_minors=(100 + 2 * n, 101 + 2 * n),
        gi_profile_id={1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[slices], placement_start=gi if gi is not None else n + 1,
        parent_name=H100, gi_memory=memory,
    )


def caps_nodes(path: Path) -> Path:
    """Stand-ins for the host's /dev/nvidia-caps nodes of mig(0..20)."""
    path.mkdir(parents=True, exist_ok=True)
    for minor in range(100, 142):
        (path / f"nvidia-cap{minor}").touch()
    return path


@pytest.fixture
def short_dir():
    """A short base directory: pipe dirs hold unix sockets (87 bytes at most)."""
    path = Path(tempfile.mkdtemp(prefix="mig-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def mig_config(mps_control, short_dir):
    def make(**overrides) -> cfg.Config:
        values = {
            "control-binary": str(mps_control),
            "pipe-dir": str(short_dir / "pipe"),
            "log-dir": str(short_dir / "log"),
            "mig-pipe-root": str(short_dir / "mig"),
            "metrics-address": "",
            "health-interval": "0.3s",
            "health-timeout": "2s",
            "restart-backoff-initial": "0.1s",
            "restart-backoff-max": "1s",
            "shutdown-timeout": "3s",
            "state-dir": str(short_dir / "state"),
            "active-thread-percentage": "60",
            "mig-caps-dir": str(caps_nodes(short_dir / "caps")),
        }
        values.update(overrides)
        return cfg.load(None, {}, values)

    return make
