"""What happens, on the real driver under `mpsd run`, when the control daemon is killed while a
client runs, and when one client makes a GPU fault. Both tests record what they see (client,
server, what mpsd reports) into the gpu-check results and assert only what mpsd promises: it
brings the daemon back and new clients are served once the faulted ones are gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from mpsd.daemon import peer
from mpsd.daemon.control import Control
from mpsd.errors import ControlError
from tests.gpu.conftest import MPSD, clean_env, mps_processes

BUSY = """
import sys, time, torch
a = torch.randn(1024, 1024, device="cuda")
n, last = 0, 0.0
try:
    while True:
        a = (a @ a).clamp_(-1, 1); torch.cuda.synchronize(); n += 1
        if time.monotonic() - last > 0.2:
            print("beat", n, flush=True); last = time.monotonic()
except Exception as exc:
    print("ERROR", type(exc).__name__, str(exc).splitlines()[0][:200], flush=True)
    sys.exit(4)
"""

FAULT = r"""
import cupy
bad = cupy.RawKernel(r'extern "C" __global__ void bad(int *p) { p[threadIdx.x] = 1; }', "bad")
bad((1,), (32,), (cupy.uint64(0xdead0000),))
cupy.cuda.runtime.deviceSynchronize()
print("no fault")
"""

SMALL = "import torch; a = torch.ones(1024, device='cuda'); print(float(a.sum()))"


class Client:
    """A client under `mpsd exec` whose output lines are collected with their times."""

    def __init__(self, node, code: str, python: str):
        self.proc = subprocess.Popen(
            [*MPSD, "exec", *node["common"], "--", python, "-c", code],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def beats_after(self, t: float) -> int:
        return sum(1 for when, line in self.lines if when > t and line.startswith("beat"))

    def wait_beat(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(line.startswith("beat") for _, line in self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.lines[-5:]
            time.sleep(0.1)

    def end(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode


def _control_pids(pipe: Path) -> list[int]:
    pids = []
    for pid in mps_processes(pipe):
        try:
            if b"mps-control" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            pass
    return pids


def _status(node) -> dict:
    out = subprocess.run([*MPSD, "status", "--json", *node["common"]], capture_output=True, text=True, timeout=60)
    try:
        return json.loads(out.stdout)
    except ValueError:
        return {"rc": out.returncode, "stderr": out.stderr[-500:]}


def _served(node, python: str, tries: int = 6) -> list[dict]:
    """Run a small client until one succeeds (or ``tries`` ran); each attempt's outcome."""
    attempts = []
    for _ in range(tries):
        out = subprocess.run(
            [*MPSD, "exec", *node["common"], "--", python, "-c", SMALL],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        attempts.append({"rc": out.returncode, "tail": (out.stdout + out.stderr).strip().splitlines()[-2:]})
        if out.returncode == 0:
            break
        time.sleep(10)
    return attempts


def test_killing_the_control_daemon_while_a_client_runs(node, torch_python, record):
    busy = Client(node, BUSY, torch_python)
    try:
        busy.wait_beat()
        servers_before = Control(node["control"], str(node["pipe"]), timeout=10).get_server_list()
        [control] = _control_pids(node["pipe"])
        killed_at = time.monotonic()
        os.kill(control, signal.SIGKILL)
        restarted_s = None
        while time.monotonic() - killed_at < 30:
            fresh = [p for p in _control_pids(node["pipe"]) if p != control]
            if fresh and _status(node).get("daemon") == "up":
                restarted_s = time.monotonic() - killed_at
                break
            time.sleep(0.2)
        time.sleep(max(0.0, 5 - (time.monotonic() - killed_at)))
        beats_after_kill = busy.beats_after(killed_at + 1)
        servers_alive = [s for s in servers_before if Path(f"/proc/{s}").exists()]
        status = _status(node)
        attempts = _served(node, torch_python)
    finally:
        busy_rc = busy.end()
    record(
        killed_control=control,
        restarted_seconds=restarted_s,
        servers_before=servers_before,
        old_servers_alive_5s_later=servers_alive,
        client_beats_1s_to_5s_after=beats_after_kill,
        client_last=[line for _, line in busy.lines[-3:]],
        client_rc=busy_rc,
        status_after=status,
        new_client_attempts=attempts,
    )
    assert restarted_s is not None, "mpsd did not bring a control daemon back within 30 s"
    assert attempts[-1]["rc"] == 0, attempts


def test_a_gpu_fault_in_one_client(node, torch_python, python_with, record):
    python_with("cupy", "import cupy; cupy.cuda.runtime.getDeviceCount()")
    bystander = Client(node, BUSY, torch_python)
    try:
        bystander.wait_beat()
        control = Control(node["control"], str(node["pipe"]), timeout=10)
        [server] = control.get_server_list()
        [daemon] = _control_pids(node["pipe"])
        # faultPolicy's proof of an MPS client (mpsd.daemon.peer): connected to the daemon or its server
        proofs = {pid: peer.mps_client_problem(pid, daemon, [server]) for pid in control.get_client_list(server)}
        faulted_at = time.monotonic()
        fault = subprocess.run(
            [*MPSD, "exec", *node["common"], "--", torch_python, "-c", FAULT],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        time.sleep(5)
        try:
            server_status = control.get_server_status(server)
        except ControlError as exc:
            server_status = f"error: {exc}"
        status = _status(node)
        bystander_alive_5s = bystander.proc.poll() is None
        beats_after = bystander.beats_after(faulted_at + 2)
    finally:
        bystander_rc = bystander.end()
    attempts = _served(node, torch_python)
    mpsd_log = node["log"].read_text(errors="replace").splitlines()
    record(
        fault_rc=fault.returncode,
        fault_tail=(fault.stdout + fault.stderr).strip().splitlines()[-3:],
        bystander_alive_5s=bystander_alive_5s,
        bystander_beats_2s_to_5s_after=beats_after,
        bystander_last=[line for _, line in bystander.lines[-3:]],
        bystander_rc=bystander_rc,
        get_server_status=server_status,
        status_after=status,
        mpsd_log_fault=[ln for ln in mpsd_log if "FAULT" in ln or "fault" in ln][-10:],
        new_client_attempts=attempts,
        client_proofs=proofs,
    )
    assert proofs and all(problem == "" for problem in proofs.values()), proofs
    assert fault.returncode != 0 and "no fault" not in fault.stdout, fault.stdout + fault.stderr
    assert attempts[-1]["rc"] == 0, f"no new client was served after the faulted ones were gone: {attempts}"
