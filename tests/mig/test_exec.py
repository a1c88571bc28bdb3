"""``mpsd exec --mig-instance MIG-<uuid> --gpu-memory 2G -- CMD``: the command is a client of that instance's
daemon (its pipe dir; the limit on device 0, the instance), with the shim preloaded; an instance mpsd
does not serve is refused in one line naming the ones it does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpsd.lifecycle.health import HealthBoard
from mpsd.mig.fleet import MigFleet
from tests.mig.conftest import mig

pytestmark = pytest.mark.mps_binary
REPO = Path(__file__).resolve().parents[2]


def mpsd_exec(config, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpsd", "exec", f"--mig-pipe-root={config.mig.pipe_root}",
         f"--state-dir={config.state_dir}", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def test_exec_inside_an_instance(mig_config, shim_lib):
    config = mig_config()
    fleet = MigFleet(config, HealthBoard())
    a, b = mig(1), mig(2)
    try:
        fleet.reconcile([a, b])
        import time

        deadline = time.monotonic() + 30
        while fleet.board.current().mig_healthy != {a.uuid, b.uuid}:
            assert time.monotonic() < deadline, "instances not healthy"
            time.sleep(0.05)
        proc = mpsd_exec(config, f"--mig-instance={a.uuid}", "--gpu-memory=2G", "--gpu-compute=25",
                         f"--shim-library={shim_lib}", "--", "env", env={"CUDA_VISIBLE_DEVICES": "3"})
        assert proc.returncode == 0, proc.stderr
        env = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == fleet.pipe_dir(a.uuid)
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2G"
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert env["LD_PRELOAD"] == str(shim_lib)
        assert "CUDA_VISIBLE_DEVICES" not in env  # the server already sees only the instance

        gone = mpsd_exec(config, "--mig-instance=MIG-99999999-1111-2222-3333-444444444444", "--no-shim", "--", "true")
        assert gone.returncode != 0
        (line,) = [x for x in gone.stderr.splitlines() if x.strip()]
        assert "no MPS daemon of mpsd serves that instance" in line
        assert a.uuid in line and b.uuid in line
        bad = mpsd_exec(config, "--mig-instance=GPU-0", "--no-shim", "--", "true")
        assert bad.returncode != 0 and "expected a MIG device UUID" in bad.stderr
    finally:
        fleet.stop()
