"""``mpsd run`` on a mixed node, end to end: the fake NVML lists a whole GPU and a GPU in MIG mode with
two instances; the real control binary runs three times (the node daemon for the whole GPU, one per
instance); the MIG layout changes while mpsd runs and the daemons follow within an inventory round."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.fakes.nvml_build import build_fake_nvml, mig_line, nvml_config_text
from tests.plugin.conftest import FakeKubelet
from tests.procs import control_daemons

pytestmark = pytest.mark.mps_binary
REPO = Path(__file__).resolve().parents[2]
GIB, MIB = 1 << 30, 1 << 20
WHOLE = "GPU-00000000-0000-0000-0000-0000000000b0"
PARENT = "GPU-00000000-0000-0000-0000-0000000000b1"
M1, M2, M3 = (f"MIG-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in (1, 2, 3))


def node(*migs: str) -> str:
    return nvml_config_text([
        (WHOLE, 80 * GIB, 0, (9, 0), False, "NVIDIA H100 80GB HBM3"),
        (PARENT, 80 * GIB, 0, (9, 0), True, "NVIDIA H100 80GB HBM3"),
    ]) + "".join(migs)


def wait_until(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()
    except OSError:
        return ""


def visible(pid: int) -> dict[str, int]:
    """CUDA_VISIBLE_DEVICES of each control daemon under ``pid`` -> its pid."""
    out = {}
    for proc in control_daemons(pid):
        try:
            out[proc.environ().get("CUDA_VISIBLE_DEVICES", "")] = proc.pid
        except Exception:
            continue
    return out


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode().strip()


def test_mixed_node_daemons_follow_the_mig_layout(mps_control, short_dir, tmp_path_factory):
    nvml = build_fake_nvml(tmp_path_factory.mktemp("nvml"))
    conf = short_dir / "nvml.conf"
    conf.write_text(node(mig_line(1, 0, M1, 7, 0, 1, 1, 16, 9984 * MIB, 0, "1g.10gb"),
                         mig_line(1, 2, M2, 2, 0, 3, 3, 60, 40192 * MIB, 0, "3g.40gb")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [f"--control-binary={mps_control}", f"--pipe-dir={short_dir / 'pipe'}", f"--log-dir={short_dir / 'log'}",
            f"--state-dir={short_dir / 'state'}", f"--metrics-address=127.0.0.1:{port}", "--health-interval=0.3s",
            f"--nvml-library={nvml}", f"--mig-pipe-root={short_dir / 'mig'}", "--shutdown-timeout=3s",
            "--device-plugin", f"--kubelet-dir={short_dir / 'kubelet'}", f"--region-dir={short_dir / 'regions'}",
            f"--shim-host-dir={short_dir / 'lib'}", f"--pod-resources-socket={short_dir / 'none.sock'}"]
    (short_dir / "kubelet").mkdir()
    kubelet = FakeKubelet(str(short_dir / "kubelet" / "kubelet.sock"))
    proc = subprocess.Popen([sys.executable, "-m", "mpsd", "run", *args], cwd=REPO,
                            env=dict(os.environ, FAKE_NVML_CONFIG=str(conf)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: proc.poll() is not None or set(visible(proc.pid)) == {WHOLE, M1, M2}, what="3 daemons")
        assert proc.poll() is None
        assert (short_dir / "mig" / M1 / "control").is_socket() and (short_dir / "mig" / M2 / "control").is_socket()
        wait_until(lambda: f'mpsd_mig_device_healthy{{gpu="1",instance="{M2}",profile="3g.40gb"}} 1.0' in scrape(port),
                   what="instance metrics")
        wait_until(lambda: 'mpsd_device_healthy{gpu="0"} 1.0' in scrape(port), what="the whole GPU healthy")
        text = scrape(port)
        assert "mpsd_mig_instances 2.0" in text
        assert 'mpsd_device_healthy{gpu="1"}' not in text  # the MIG GPU is not offered whole
        wait_until(lambda: len(kubelet.requests) >= 3, what="three resources registered")
        assert sorted(r.resource_name for r in kubelet.requests) == [
            "mpsd.io/gpu", "mpsd.io/mig-1g.10gb", "mpsd.io/mig-3g.40gb"]
        # every face serves, the MIG plugins too: ready (a MIG runner that never said it serves
        # left /readyz at "MIG device plugins starting")
        wait_until(lambda: readyz(port) == (200, "ok"), what="/readyz 200")
        kept = visible(proc.pid)[M1]
        mtime = conf.stat().st_mtime_ns + 10**9
        conf.write_text(node(mig_line(1, 0, M1, 7, 0, 1, 1, 16, 9984 * MIB, 0, "1g.10gb"),
                             mig_line(1, 1, M3, 1, 0, 2, 2, 32, 20096 * MIB, 0, "2g.20gb")))
        os.utime(conf, ns=(mtime, mtime))
        wait_until(lambda: set(visible(proc.pid)) == {WHOLE, M1, M3}, what="layout followed")
        assert visible(proc.pid)[M1] == kept  # the unchanged instance's daemon was left alone
        wait_until(lambda: M2 not in scrape(port) and f'instance="{M3}"' in scrape(port), what="metrics followed")
        wait_until(lambda: "mpsd.io/mig-2g.20gb" in [r.resource_name for r in kubelet.requests], what="new profile")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        kubelet.stop()
    assert proc.returncode == 0, out[-3000:]
    assert "MIG instance gone, stopping its daemon" in out
