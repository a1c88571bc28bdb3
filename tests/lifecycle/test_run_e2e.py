"""``mpsd run`` end to end: the real MPS control binary, the fake NVML, the device plugin
registered with a fake kubelet, metrics and probes; a SIGKILL of the daemon is seen by the
kubelet as Unhealthy slices that turn Healthy again after the restart."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from mpsd.plugin import api_pb2, api_pb2_grpc
from tests.fakes.nvml_build import build_fake_nvml, nvml_config_text
from tests.procs import control_daemon

pytestmark = pytest.mark.mps_binary
REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
UUID = "GPU-00000000-1111-2222-3333-444444444444"


class Kubelet(api_pb2_grpc.RegistrationServicer):
    def __init__(self, path: str) -> None:
        self.requests: list = []
        self.registered = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port("unix://" + path)
        self.server.start()

    def Register(self, request, context):
        self.requests.append(request)
        self.registered.set()
        return api_pb2.Empty()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def ready(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def wait_until(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def short_dir():
    path = Path(tempfile.mkdtemp(prefix="mpsd-e2e-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_run_with_plugin_metrics_and_recovery(mps_control, short_dir, tmp_path_factory):
    nvml = build_fake_nvml(tmp_path_factory.mktemp("nvml"))
    nvml_conf = short_dir / "nvml.conf"
    nvml_conf.write_text(
        nvml_config_text([(UUID, 40 * GIB, 3 * GIB, (9, 0), False, "Fake H100")], mps_clients=[(0, 4242, 2 * GIB)])
    )
    (short_dir / "kubelet").mkdir()
    kubelet = Kubelet(str(short_dir / "kubelet" / "kubelet.sock"))
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [
        f"--control-binary={mps_control}",
        f"--pipe-dir={short_dir / 'pipe'}",
        f"--log-dir={short_dir / 'log'}",
        f"--state-dir={short_dir / 'state'}",
        f"--metrics-address=127.0.0.1:{port}",
        "--health-interval=0.5s",
        f"--nvml-library={nvml}",
        "--device-plugin",
        "--slices-per-gpu=4",
        f"--kubelet-dir={short_dir / 'kubelet'}",
        f"--pod-resources-socket={short_dir / 'none.sock'}",
        f"--region-dir={short_dir / 'regions'}",
        f"--shim-host-dir={short_dir / 'lib'}",
    ]
    env = dict(os.environ, FAKE_NVML_CONFIG=str(nvml_conf))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpsd", "run", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    channel = None
    try:
        wait_until(lambda: proc.poll() is not None or ready(port) == 200, what="ready")
        assert proc.poll() is None
        assert kubelet.registered.wait(30)
        request = kubelet.requests[0]
        assert request.resource_name == "mpsd.io/gpu"
        wait_until(
            lambda: 'mpsd_client_memory_bytes{gpu="0",pid="4242"} 2.147483648e+09' in scrape(port), what="NVML metrics"
        )
        text = scrape(port)
        assert f'mpsd_gpu_memory_total_bytes{{gpu="0",uuid="{UUID}"}} 4.294967296e+10' in text
        assert 'mpsd_mps_clients{gpu="0"} 1.0' in text
        assert 'mpsd_device_healthy{gpu="0"} 1.0' in text
        assert "mpsd_daemon_up 1.0" in text

        status = subprocess.run(
            [sys.executable, "-m", "mpsd", "status", "--json", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        data = json.loads(status.stdout)
        assert status.returncode == 0 and data["daemon"] == "up"
        assert [(g["index"], g["uuid"], g["memory_total"]) for g in data["gpus"]] == [(0, UUID, 40 * GIB)]
        assert data["nvmlClients"] == [{"gpu": 0, "pid": 4242, "usedMemory": 2 * GIB}]

        channel = grpc.insecure_channel("unix://" + str(short_dir / "kubelet" / request.endpoint))
        stream = api_pb2_grpc.DevicePluginStub(channel).ListAndWatch(api_pb2.Empty(), timeout=120)
        first = next(stream)
        assert len(first.devices) == 4 and {d.health for d in first.devices} == {"Healthy"}

        daemon = control_daemon(proc.pid)
        assert daemon is not None, "no control daemon under mpsd run"
        os.kill(daemon.pid, signal.SIGKILL)
        seen = []
        for update in stream:
            seen.append({d.health for d in update.devices})
            if seen[-1] == {"Healthy"}:
                break
        assert {"Unhealthy"} in seen and seen[-1] == {"Healthy"}
        wait_until(lambda: "mpsd_daemon_restarts_total 1.0" in scrape(port), what="restart counted")
        assert ready(port) == 200
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if channel is not None:
            channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kubelet.server.stop(grace=0).wait()
    assert proc.returncode == 0, out
    assert not (short_dir / "kubelet" / request.endpoint).exists()
