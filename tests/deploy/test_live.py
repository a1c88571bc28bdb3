"""The shipped configs run: `mpsd run --config <each config in deploy/>` with the real
nvidia-cuda-mps-control, answers the probes its manifest declares, and on SIGTERM exits 0,
leaving no process behind, within the grace its manifest or unit gives it. A config with
`daemonLifecycle: independent` runs beside `mpsd holder` on the same file: mpsd's SIGTERM leaves
the holder's daemon running, and the holder's SIGTERM stops it within the same grace.

Host paths are redirected under a temporary directory with flags (flag > file), and the
metrics port to a free local one; everything else comes from the shipped file."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tests.deploy.conftest import REPO, one, rendered
from tests.deploy.test_systemd import get as unit_setting
from tests.deploy.test_systemd import systemd_seconds

pytestmark = pytest.mark.mps_binary


def daemonset_probes(name: str) -> tuple[list[str], float]:
    spec = one(rendered(name), "DaemonSet", "mpsd")["spec"]["template"]["spec"]
    c = spec["containers"][0]
    return [c[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe")], spec["terminationGracePeriodSeconds"]


def sidecar_probes() -> tuple[list[str], float]:
    spec = one(rendered("deploy/sidecar"), "Deployment", "inference-mps")["spec"]["template"]["spec"]
    c = next(c for c in spec["initContainers"] if c["name"] == "mpsd")
    probes = [c[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")]
    return probes, spec["terminationGracePeriodSeconds"]


CASES = {
    "daemonset": ("deploy/base/config.yaml", lambda: daemonset_probes("deploy")),
    "daemonset-tmpfs": ("deploy/overlays/tmpfs/config.yaml", lambda: daemonset_probes("deploy/overlays/tmpfs")),
    "sidecar": ("deploy/sidecar/config.yaml", sidecar_probes),
    "systemd": ("deploy/systemd/config.yaml",
                lambda: (["/healthz", "/readyz"], systemd_seconds(unit_setting("TimeoutStopSec")))),
}


@pytest.fixture(scope="module")
def mps_control_binary() -> Path:
    from tests.mpsbin import FetchError, ensure_mps_control
    try:
        return ensure_mps_control()
    except FetchError as exc:  # CI has the network: a failed fetch is a failure, not a skip
        pytest.fail(f"could not fetch nvidia-cuda-mps-control: {exc}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def wait_for(url: str, deadline_s: float) -> int:
    end = time.monotonic() + deadline_s
    code = 0
    while time.monotonic() < end:
        code = status(url)
        if code == 200:
            return code
        time.sleep(0.2)
    return code


def mpsd_argv(config: Path, tmp: Path, binary: Path, port: int, fake_nvml: Path) -> list[str]:
    raw: dict[str, Any] = yaml.safe_load(config.read_text())
    argv = [sys.executable, "-c", "import sys; from mpsd.cli import main; sys.exit(main())", "run",
            "--config", str(config), "--control-binary", str(binary),
            "--pipe-dir", str(tmp / "pipe"), "--log-dir", str(tmp / "log"), "--state-dir", str(tmp / "state"),
            "--metrics-address", f"127.0.0.1:{port}", "--nvml-library", str(fake_nvml)]
    if raw["devicePlugin"].get("enabled"):
        argv += ["--kubelet-dir", str(tmp / "kubelet"), "--pod-resources-socket", str(tmp / "pr/kubelet.sock"),
                 "--region-dir", str(tmp / "state/regions"), "--shim-host-dir", str(tmp / "state/lib"),
                 "--shm-dir", str(tmp / "shm")]
    return argv


@pytest.mark.parametrize("case", sorted(CASES))
def test_shipped_config_runs_answers_its_probes_and_stops_in_time(
        case: str, tmp_path: Path, mps_control_binary: Path, fake_cuda_dir: Path, shim_lib: Path) -> None:
    config_rel, probes_of = CASES[case]
    probes, grace_s = probes_of()
    (tmp_path / "kubelet").mkdir()
    nvml_config = tmp_path / "nvml.conf"
    nvml_config.write_text("gpu 0 GPU-00000000-0000-0000-0000-000000000000 85899345920 0 9 0 0 Fake H100\n")
    port = free_port()
    env = {**os.environ, "FAKE_NVML_CONFIG": str(nvml_config), "MPSSHIM_LIBRARY": str(shim_lib)}
    argv = mpsd_argv(REPO / config_rel, tmp_path, mps_control_binary, port, fake_cuda_dir / "libnvidia-ml.so.1")
    independent = yaml.safe_load((REPO / config_rel).read_text()).get("daemonLifecycle") == "independent"
    holder = None
    if independent:  # the daemon is the holder's (deploy/systemd/mpsd-holder.service), started first
        holder_log = open(tmp_path / "holder.log", "w")  # noqa: SIM115 (closed below)
        holder = subprocess.Popen([*argv[:3], "holder", *argv[4:]], env=env, stdout=holder_log, stderr=subprocess.STDOUT)
        # Under systemd mpsd.service (a .service cgroup) waits for the holder's daemon; this test's
        # mpsd runs in no unit and would start one itself if it came first.
        from mpsd.genuine import control_lock_holder

        end = time.monotonic() + 60
        while control_lock_holder(str(tmp_path / "pipe")) is None:
            assert holder.poll() is None and time.monotonic() < end, (tmp_path / "holder.log").read_text()
            time.sleep(0.05)
    log = open(tmp_path / "mpsd.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        for path in probes:
            # the sidecar's startupProbe allows 60 s; be as patient on a busy 2-core machine
            assert wait_for(f"http://127.0.0.1:{port}{path}", 60) == 200, (path, (tmp_path / "mpsd.log").read_text())
        assert status(f"http://127.0.0.1:{port}/metrics") == 200
        parent = holder if holder is not None else proc
        children = psutil.Process(parent.pid).children(recursive=True)
        assert children, "no control daemon started"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=grace_s)
        took = time.monotonic() - started
        if holder is not None:  # mpsd left the holder's daemon running; the holder stops it in time
            assert all(c.is_running() for c in children), "mpsd stopped the holder's daemon"
            started = time.monotonic()
            holder.send_signal(signal.SIGTERM)
            assert holder.wait(timeout=grace_s) == 0, (tmp_path / "holder.log").read_text()
            assert time.monotonic() - started < grace_s
    finally:
        for p in (proc, holder):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        log.close()
        if holder is not None:
            holder_log.close()
    assert rc == 0, (tmp_path / "mpsd.log").read_text()
    assert took < grace_s
    psutil.wait_procs(children, timeout=5)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
