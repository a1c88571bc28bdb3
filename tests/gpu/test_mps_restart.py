"""A CUDA client keeps running while `mpsd run` is stopped, killed and restarted with another
config (`daemonLifecycle: independent`, the daemon kept by `mpsd holder`): the driver's own
nvidia-cuda-mps-control on a private pipe dir, a PyTorch client under `mpsd exec` computing
throughout. Owned mode's SIGTERM ends such a client (docs/operations.md, "Upgrading mpsd");
this is the check that independent mode does not.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from mpsd.daemon import genuine
from mpsd.daemon.control import Control
from tests.gpu.conftest import MPSD, clean_env, mps_processes, tempfile_short
from tests.rollout import free_port, http_get

# Computes until stdin closes: one JSON line per second with the iterations done so far.
LOOP = """
import json, os, sys, threading, time, torch
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
x = torch.randn(2048, 2048, device="cuda")
keep = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
done, last = 0, time.monotonic()
while not stop.is_set():
    y = x @ x
    torch.cuda.synchronize()
    done += 1
    if time.monotonic() - last >= 1.0:
        last = time.monotonic()
        print(json.dumps({"pid": os.getpid(), "done": done, "sum_ok": bool(torch.isfinite(y.sum()))}), flush=True)
print(json.dumps({"pid": os.getpid(), "done": done, "final": True}), flush=True)
"""


class Lines:
    """The client's JSON lines, read in a thread (the client writes one a second)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.items: list[dict] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                self.items.append(json.loads(line))
            except ValueError:
                pass

    def done(self) -> int:
        return self.items[-1]["done"] if self.items else 0

    def advances(self, timeout: float = 60) -> bool:
        """True once the client reports more iterations than now."""
        before, deadline = self.done(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.done() > before:
                return True
            time.sleep(0.2)
        return False


@pytest.fixture
def held_node(request, record):
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("the driver's nvidia-cuda-mps-control is not on PATH")
    base = Path(tempfile_short())
    pipe, logs, port = base / "pipe", base / "log", free_port()
    common = ["--control-binary", control, "--pipe-dir", str(pipe), "--log-dir", str(logs),
              "--state-dir", str(base / "state")]  # fmt: skip
    run_args = [*common, "--daemon-lifecycle", "independent", "--metrics-address", f"127.0.0.1:{port}",
                "--health-interval", "1s"]  # fmt: skip
    started: list[subprocess.Popen] = []

    def spawn(command: str, *args: str) -> subprocess.Popen:
        out = (base / f"{command}-{len(started)}.log").open("w")
        proc = subprocess.Popen([*MPSD, command, *args], stdout=out, stderr=subprocess.STDOUT, env=clean_env())
        started.append(proc)
        return proc

    def run(*extra: str) -> tuple[subprocess.Popen, float]:
        began = time.monotonic()
        proc = spawn("run", *run_args, *extra)
        while http_get(port, "/readyz")[0] != 200:
            assert proc.poll() is None and time.monotonic() - began < 60, "mpsd run did not become ready"
            time.sleep(0.01)
        return proc, time.monotonic() - began

    node = {"pipe": pipe, "logs": logs, "common": common, "control": control, "spawn": spawn, "run": run}
    yield node
    for proc in reversed(started):  # the holder last: its SIGTERM quits the daemon
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while mps_processes(pipe) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = mps_processes(pipe)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    keep = os.environ.get("GPU_CHECK_RECORDS")
    if keep:
        for path in [*base.glob("*.log"), logs / "control.log", logs / "server.log"]:
            if path.is_file():
                Path(keep).mkdir(parents=True, exist_ok=True)
                shutil.copy(path, Path(keep) / f"{request.node.name}.{path.name}")
    shutil.rmtree(base, ignore_errors=True)
    assert not left, f"MPS processes {left} outlived the holder"


def test_a_cuda_client_keeps_running_across_mpsd_restarts(held_node, torch_python, record):
    node = held_node
    node["spawn"]("holder", *node["common"])
    pipe = str(node["pipe"])
    deadline = time.monotonic() + 60
    while genuine.control_lock_holder(pipe) is None:
        assert time.monotonic() < deadline, "the holder started no daemon"
        time.sleep(0.1)
    daemon = genuine.control_lock_holder(pipe)
    run, _ = node["run"]()
    client = subprocess.Popen(
        [*MPSD, "exec", *node["common"], "--gpu-compute", "50", "--", torch_python, "-c", LOOP],
        env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines = Lines(client)
    try:
        assert lines.advances(120), client.stderr.read() if client.poll() is not None else "no progress"
        control = Control(node["control"], pipe, str(node["logs"]), timeout=10)
        servers = control.get_server_list()
        assert len(servers) == 1
        client_pid = lines.items[-1]["pid"]
        assert client_pid in control.get_client_list(servers[0])
        figures: dict[str, object] = {}
        for name, sig, extra in (("sigterm", signal.SIGTERM, ()), ("sigkill", signal.SIGKILL, ()),
                                 ("config", signal.SIGTERM, ("--active-thread-percentage", "80"))):  # fmt: skip
            run.send_signal(sig)
            run.wait(timeout=60)
            run, seconds = node["run"](*extra)
            assert lines.advances(), f"{name}: the client stopped computing"
            assert client.poll() is None, client.stderr.read()
            assert genuine.control_lock_holder(pipe) == daemon, f"{name}: the daemon was replaced"
            assert control.get_server_list() == servers and client_pid in control.get_client_list(servers[0])
            figures[f"{name}_ready_s"] = round(seconds, 3)
        assert control.get_default_active_thread_percentage() == 80.0
        assert "Cmd:quit" not in (node["logs"] / "control.log").read_text()
        after = subprocess.run(  # a new client after the restarts is served too
            [*MPSD, "exec", *node["common"], "--", torch_python, "-c",
             "import torch; a = torch.ones(1024, 1024, device='cuda'); print(float(a.sum()))"],
            env=clean_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert after.returncode == 0 and "1048576.0" in after.stdout, after.stderr
        figures["iterations"] = lines.done()
        record(**figures)
    finally:
        if client.poll() is None:
            client.stdin.close()
            client.wait(timeout=120)
    assert client.returncode == 0, client.stderr.read()[-2000:]
    assert all(item.get("sum_ok", True) for item in lines.items)
