"""Reading the regions of `mpsd exec` is off `mpsd run`'s start path: the daemon starts, /readyz
turns ready and SIGTERM stops mpsd at once however long that read takes. Real mpsd run, real
nvidia-cuda-mps-control; the read is made slow (a hung disk, thousands of files) by a
``sitecustomize`` that holds ``ExecRegions.__call__`` until the test lets it go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cli import flags, free_port, wait_ready

REPO = Path(__file__).resolve().parents[2]
HOLD = """
import os, time
import mpsd.metrics.regions as regions

_real = regions.ExecRegions.__call__

def held(self):
    open(os.environ["TEST_READING"], "w").close()
    deadline = time.monotonic() + 300
    while not os.path.exists(os.environ["TEST_RELEASE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _real(self)

regions.ExecRegions.__call__ = held
"""


@pytest.mark.mps_binary
def test_a_slow_read_of_exec_regions_delays_neither_the_start_nor_sigterm(mps_control, mps_dirs, tmp_path):
    instrument = tmp_path / "instrument"
    instrument.mkdir()
    (instrument / "sitecustomize.py").write_text(HOLD)
    reading, release = tmp_path / "reading", tmp_path / "release"
    port = free_port()
    args = flags(mps_control, mps_dirs, **{"metrics-address": f"127.0.0.1:{port}"})
    region = mps_dirs[0].parent / "state" / "exec" / "one"
    region.mkdir(parents=True)
    (region / "region").write_bytes(b"")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(instrument), str(REPO)]),
               TEST_READING=str(reading), TEST_RELEASE=str(release))
    proc = subprocess.Popen([sys.executable, "-m", "mpsd", "run", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(proc, port, why="not ready while the regions were being read")
        assert reading.exists() and not release.exists()  # ready while the read still hangs
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "daemon stopped" in out
    finally:
        release.touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
