"""mpsd.inventory.nvml against the real NVML (needs a GPU and its driver; skipped elsewhere).

Runs in a subprocess: in this process pynvml may already be pointed at the fake."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys
from mpsd.errors import InventoryError
from mpsd.inventory.nvml import Inventory
try:
    inv = Inventory()
except InventoryError as e:
    print(json.dumps({"skip": str(e)})); sys.exit(0)
with inv:
    out = {"driver": inv.driver_version(),
           "gpus": [[g.index, g.uuid, g.name, g.memory_total, g.memory_used, list(g.compute_capability),
                     g.mig_enabled] for g in inv.gpus()],
           "clients": [[c.gpu_index, c.pid, c.used_memory] for c in inv.mps_clients()]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def real() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FAKE_NVML_CONFIG"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    if "skip" in result:
        pytest.skip(f"no usable NVML: {result['skip']}")
    return result


@pytest.mark.gpu
def test_real_gpus_are_listed_with_sane_fields(real: dict) -> None:
    assert real["gpus"], "NVML loaded but reports no GPU"
    for index, (i, uuid, name, total, used, cc, mig) in enumerate(real["gpus"]):
        assert i == index and uuid.startswith(("GPU-", "MIG-")) and name
        assert 0 <= used <= total and total > 1 << 30
        assert cc[0] >= 3 and isinstance(mig, bool)
    assert real["driver"].split(".")[0].isdigit()


@pytest.mark.gpu
def test_real_inventory_matches_nvidia_smi(real: dict) -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi not on PATH")
    out = subprocess.run(
        [smi, "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    rows = [[field.strip() for field in line.split(",")] for line in out.strip().splitlines()]
    assert [(int(i), uuid) for i, uuid, _ in rows] == [(g[0], g[1]) for g in real["gpus"]]
    for (_, _, mib), gpu in zip(rows, real["gpus"], strict=True):
        assert int(mib) == pytest.approx(gpu[3] / (1 << 20), rel=0.01)  # smi may round or use another call


@pytest.mark.gpu
def test_real_mps_clients_query_answers(real: dict) -> None:
    gpu_indices = {g[0] for g in real["gpus"]}
    for gpu, pid, used in real["clients"]:
        assert gpu in gpu_indices and pid > 0 and (used is None or used >= 0)
