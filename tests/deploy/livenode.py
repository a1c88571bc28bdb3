"""A live node for the monitoring tests: a real `mpsd run` (the real nvidia-cuda-mps-control,
the fake NVML with one GPU and one MPS client) with its device plugin registered with a fake
kubelet, one allocation handed out over real gRPC and attributed to a pod by a fake
pod-resources server, a client of that pod holding memory in the allocation's region, and an
`mpsd exec` client holding memory in a region under <stateDir>/exec, as scripts/demo.sh runs it.

Beside it, `fed_exporter` serves what such a node cannot show without a fault (a last error,
a server in FAULT, an unhealthy device): mpsd's own Metrics, fed those values, over HTTP.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from mpsd.inventory.nvml import Client, Gpu
from mpsd.plugin.metrics import AllocationUsage
from mpsd.registry import Metrics
from mpsd.metrics.http import Server, serve
from mpsd.plugin import api_pb2
from tests.deploy.prometheus import free_port
from tests.plugin.conftest import RESOURCE, FakeKubelet, FakePodResources, allocate, stub

REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "scripts/demo_client.py"
G = 1 << 30
POD = ("web-0", "serving", "vllm")  # pod, namespace, container of the one allocation
EXEC_REGION = "web"  # name of the mpsd exec region
WAIT = 60.0  # seconds for anything the node does on its own, on a busy 2-core machine


@dataclass
class LiveNode:
    port: int  # of /metrics
    work: Path


def get(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return resp.read().decode()


def _scrape(port: int) -> str:
    try:
        return get(port)
    except OSError:
        return ""


def wait_until(predicate, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.2)


@contextmanager
def _process(argv: list[str], env: dict[str, str], log: Path, holding: bool = False) -> Iterator[None]:
    """A child process, SIGTERMed (then killed) at the end. ``holding``: wait for the demo
    client's "holding" line."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        if holding:
            wait_until(lambda: proc.poll() is not None or "holding" in log.read_text(), f"{argv[-4:]} to hold")
            assert proc.poll() is None, log.read_text()
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, f"{argv[:4]} exited {proc.returncode}:\n{log.read_text()}"


def _mpsd_args(work: Path, control: Path) -> list[str]:
    return [f"--control-binary={control}", f"--pipe-dir={work}/pipe", f"--log-dir={work}/log",
            f"--state-dir={work}/state"]  # fmt: skip


def _run_argv(work: Path, control: Path, fakes: Path, shim_lib: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "mpsd", "run", *_mpsd_args(work, control),
            f"--nvml-library={fakes}/libnvidia-ml.so.1", f"--metrics-address=127.0.0.1:{port}",
            "--health-interval=0.5s", f"--shim-library={shim_lib}",
            "--device-plugin", "--slices-per-gpu=4", f"--kubelet-dir={work}/kubelet",
            f"--pod-resources-socket={work}/pr.sock", f"--region-dir={work}/regions",
            f"--shim-host-dir={work}/lib"]  # fmt: skip


def _allocate_one(kubelet: FakeKubelet, pods: FakePodResources, work: Path) -> tuple[dict[str, str], str]:
    """Allocate one slice as the kubelet does and list it as the pod's; returns the
    container's environment and the host path of its region directory."""
    assert kubelet.registered.wait(WAIT), "the device plugin never registered"
    channel, plugin = stub(str(work / "kubelet" / kubelet.requests[0].endpoint))
    with channel:
        device = next(plugin.ListAndWatch(api_pb2.Empty(), timeout=WAIT))
        ids = [device.devices[0].ID]
        reply = allocate(plugin, ids).container_responses[0]
    pods.pods = [(*POD, RESOURCE, ids)]
    region_dir = next(m.host_path for m in reply.mounts if m.container_path == "/run/mpsd")
    return dict(reply.envs), region_dir


@contextmanager
def live_node(control: Path, fakes: Path, shim_lib: Path) -> Iterator[LiveNode]:
    """The node described above, once its allocation, region and NVML series are scraped."""
    work = Path(tempfile.mkdtemp(prefix="mpsd-live-", dir="/tmp"))  # short: it holds sockets
    work.chmod(0o711)
    (work / "kubelet").mkdir()
    (work / "nvml.conf").write_text(
        f"gpu 0 GPU-face0000-0000-0000-0000-000000000000 {16 * G} {3 * G} 9 0 0 Fake GPU\nproc 0 4242 {3 * G}\n"
    )
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LD_PRELOAD", "CUDA_MPS_", "MPSSHIM_"))}
    client_env = dict(base, LD_LIBRARY_PATH=str(fakes), FAKE_CUDA_DEVICES="16G", MPSSHIM_LIBRARY=str(shim_lib))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        kubelet = FakeKubelet(str(work / "kubelet" / "kubelet.sock"))
        stack.callback(kubelet.stop)
        pods = FakePodResources(str(work / "pr.sock"))
        stack.callback(pods.stop)
        run_env = dict(base, FAKE_NVML_CONFIG=str(work / "nvml.conf"))
        stack.enter_context(_process(_run_argv(work, control, fakes, shim_lib, port), run_env, work / "run.log"))
        wait_until(lambda: "mpsd_daemon_up 1.0" in _scrape(port), "mpsd run to be up")
        envs, region_dir = _allocate_one(kubelet, pods, work)
        pod_env = {**client_env, **envs, "LD_PRELOAD": str(shim_lib), "MPSSHIM_REGION": f"{region_dir}/region"}
        hold = [sys.executable, str(CLIENT), "pod", "--allocate", "1G", "--hold"]
        stack.enter_context(_process(hold, pod_env, work / "pod.log", holding=True))
        region = work / "state/exec" / EXEC_REGION / "region"
        region.parent.mkdir(parents=True)
        exec_argv = [sys.executable, "-m", "mpsd", "exec", *_mpsd_args(work, control), "--gpu-memory=4G",
                     f"--region={region}", "--", sys.executable, str(CLIENT), "exec", "--allocate", "1G", "--hold"]
        stack.enter_context(_process(exec_argv, client_env, work / "exec.log", holding=True))
        wanted = (f'pod="{POD[0]}"', "mpsd_region_process_memory_bytes{", "mpsd_client_memory_bytes{")
        wait_until(lambda: all(w in _scrape(port) for w in wanted), f"{wanted} in /metrics")
        yield LiveNode(port, work)


def fed_exporter() -> Server:
    """mpsd's exporter fed what the live node cannot show, served on a free loopback port."""
    m = Metrics()
    m.update_supervisor(
        daemon_up=True, restarts=2, health_latency=0.01, last_error="daemon pid=7 hung", servers={0: 1},
        config_generation=3,
    )  # fmt: skip
    m.set_faulted_servers(1)
    m.set_device_health({0: False})
    m.observe_inventory([Gpu(0, "GPU-1", "H100", 80 * G, 3 * G, (9, 0), False)], [Client(0, 4242, G)])
    m.set_allocations([AllocationUsage("a1", "web-1", "serving", "vllm", 0, 8 * G, 3 * G)])
    return serve("127.0.0.1:0", m, lambda: True, lambda: True)
