"""MIG on real hardware: what mpsd discovers matches `nvidia-smi -L`, each instance gets its own
daemon under `mpsd run`, and a client of `mpsd exec --mig-instance` runs inside the instance with
its slice. Skipped, saying why, where no GPU is in MIG mode or MIG mode has no instances: these
tests never change a GPU's MIG mode or its instances (that is the operator's, docs/mig.md)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.gpu.conftest import MPSD, clean_env, mps_processes, tempfile_short

GIB = 1 << 30
_LINE = re.compile(r"\s+MIG\s+(\S+)\s+Device\s+\d+:\s+\(UUID:\s+(MIG-[^)]+)\)")


def smi_instances() -> dict[str, str]:
    """{MIG UUID: profile} as `nvidia-smi -L` lists them."""
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    return {m.group(2): m.group(1) for m in map(_LINE.match, out.splitlines()) if m}


@pytest.fixture(scope="module")
def layout():
    """(GPUs, instances) from mpsd's own discovery; skips where there is nothing of MIG to test."""
    from mpsd.errors import InventoryError
    from mpsd.inventory.nvml import Inventory

    try:
        with Inventory() as inventory:
            gpus = inventory.gpus()
            instances = inventory.mig_devices(gpus)
    except InventoryError as exc:
        pytest.skip(f"NVML not usable: {exc}")
    if not any(g.mig_enabled for g in gpus):
        pytest.skip("no GPU here is in MIG mode (MIG mode Disabled on every GPU); these tests never change it")
    if not instances:
        pytest.skip("MIG mode is enabled but no instance exists; these tests never create one")
    return gpus, instances


def test_discovery_matches_nvidia_smi(layout, record):
    gpus, instances = layout
    assert {d.uuid: d.profile for d in instances} == smi_instances()
    for d in instances:
        parent = next(g for g in gpus if g.index == d.parent_index)
        assert parent.mig_enabled and d.parent_uuid == parent.uuid
        assert 0 < d.memory_total <= parent.memory_total and d.sm_count > 0
    record(instances=[d.describe() for d in instances],
           caps=[(d.uuid, d.caps_minors) for d in instances])


@pytest.fixture
def mig_node(layout):
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("the driver's nvidia-cuda-mps-control is not on PATH")
    base = Path(tempfile_short())
    common = ["--control-binary", control, "--pipe-dir", str(base / "pipe"), "--log-dir", str(base / "log"),
              "--state-dir", str(base / "state"), "--mig-pipe-root", str(base / "mig")]
    log = (base / "mpsd-run.log").open("w")
    proc = subprocess.Popen([*MPSD, "run", *common, "--metrics-address", "", "--health-interval", "1s"],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    pipes = [base / "mig" / d.uuid for d in layout[1]]
    deadline = time.monotonic() + 60
    while not all((p / "control").is_socket() for p in pipes):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"instance daemons did not come up:\n{(base / 'mpsd-run.log').read_text()[-3000:]}")
        time.sleep(0.5)
    yield {"common": common, "instances": layout[1], "base": base}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    log.close()
    left = [pid for p in pipes for pid in mps_processes(p)]
    shutil.rmtree(base, ignore_errors=True)
    assert not left, f"MPS processes {left} outlived mpsd"


PROBE = """
import json, torch
p = torch.cuda.get_device_properties(0)
x = torch.randn(1024, 1024, device="cuda"); y = float((x @ x).sum())
print(json.dumps({"sms": p.multi_processor_count, "total": torch.cuda.mem_get_info()[1], "name": p.name}))
"""


def test_a_client_runs_inside_an_instance_with_its_slice(mig_node, torch_python, record):
    instance = max(mig_node["instances"], key=lambda d: d.memory_total)
    out = subprocess.run([*MPSD, "exec", *mig_node["common"], "--mig-instance", instance.uuid, "--gpu-memory", "1G",
                          "--gpu-compute", "50", "--", torch_python, "-c", PROBE],
                         env=clean_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    record(instance=instance.describe(), client=seen)
    assert seen["total"] == GIB  # the shim's cap, inside the instance
    assert 0 < seen["sms"] <= instance.sm_count
