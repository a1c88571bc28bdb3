"""``mpsd run`` as a process on a node whose control binary speaks MPS v3 and whose driver is
R615 (the stand-ins): auto picks v3, the daemon starts with mpsd's file, ``mpsd status`` says
which backend and what enforces memory, SIGTERM quits it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.sharing.conftest import wait_for
from tests.sharing.test_check_config import GPU


def test_mpsd_run_auto_picks_v3_and_status_says_so(tmp_path, short_tmp, fake_v3_binary, fake_nvml_lib):
    (tmp_path / "nvml.conf").write_text(GPU + "driver 615.20.01\n")
    env = dict(os.environ, FAKE_NVML_CONFIG=str(tmp_path / "nvml.conf"))
    flags = ["--control-binary", str(fake_v3_binary), "--nvml-library", str(fake_nvml_lib),
             "--pipe-dir", str(short_tmp / "p"), "--log-dir", str(short_tmp / "log"),
             "--state-dir", str(short_tmp / "state"), "--metrics-address", "", "--health-interval", "0.3s",
             "--cgroup-root", str(short_tmp)]
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mpsd", "run", *flags], env=env, stdout=log, stderr=log)
    try:
        assert wait_for(lambda: (short_tmp / "p" / "g0" / "default" / "control").exists(), timeout=30), \
            (tmp_path / "run.log").read_text()
        text = (tmp_path / "run.log").read_text()
        assert "sharing backend mps-v3" in text and "615.20.01" in text
        assert "memory partitioning by cgroup: not used" in text  # the fake NVML has no memlimits here
        status = subprocess.run([sys.executable, "-m", "mpsd", "status", *flags], env=env, capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "sharing: mps-v3" in status.stdout and "namespace g0/default" in status.stdout
        assert "the shim" in status.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        log.close()
    assert code == 0, (tmp_path / "run.log").read_text()
    assert not (short_tmp / "p" / "control").exists()  # -q: the daemon is gone with its sockets
