"""The real MPS daemon, supervised by `mpsd run`, serving real PyTorch clients.

Uses the driver's own nvidia-cuda-mps-control and a private pipe directory (the `node` fixture
of conftest.py); never changes the compute mode. The daemon is stopped through mpsd (SIGTERM)
before each test ends, and no MPS process of that pipe directory may outlive it.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import time
from dataclasses import asdict

from mpsd.daemon.control import Control
from mpsd.errors import ControlError
from tests.gpu.conftest import MPSD, clean_env, mps_processes

GIB = 1 << 30

HOLD = """
import json, os, sys, torch
x = torch.empty({nbytes}, dtype=torch.uint8, device="cuda")
p = torch.cuda.get_device_properties(0)
free, total = torch.cuda.mem_get_info()
print(json.dumps({{"pid": os.getpid(), "sms": p.multi_processor_count, "total": total, "free": free,
                  "props_total": p.total_memory}}), flush=True)
sys.stdin.read()
"""


def _exec(node, *mpsd_args: str, code: str, python: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MPSD, "exec", *node["common"], *mpsd_args, "--", python, "-c", code],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _start(node, *mpsd_args: str, code: str, python: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*MPSD, "exec", *node["common"], *mpsd_args, "--", python, "-c", code],
        env=clean_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stop(client: subprocess.Popen) -> str:
    client.stdin.close()
    try:
        client.wait(timeout=120)
    except subprocess.TimeoutExpired:
        client.kill()
        client.wait()
    return client.stderr.read()[-1000:]


def _ask(control: Control, command: str) -> str:
    try:
        return control.call(command).strip()
    except ControlError as exc:  # recorded: what this driver's daemon says to it
        return f"error: {exc}"


def _control(node) -> Control:
    return Control(node["control"], str(node["pipe"]), str(node["logs"]), timeout=10)


def test_client_runs_through_the_mps_server(node, torch_python):
    code = "import torch; a = torch.randn(2048, 2048, device='cuda'); print(float((a @ a).sum()) != 0.0)"
    out = _exec(node, "--gpu-compute", "50", code=code, python=torch_python)
    assert out.returncode == 0 and "True" in out.stdout, out.stderr
    control_log = (node["logs"] / "control.log").read_text()
    assert "Starting new server" in control_log or "New client" in control_log, control_log[-2000:]


def test_mps_server_enforces_the_pinned_limit_without_the_shim(node, torch_python):
    code = (
        "import sys, torch\n"
        "try:\n    torch.empty(3 << 30, dtype=torch.uint8, device='cuda')\n"
        "except torch.OutOfMemoryError:\n    sys.exit(3)\n"
    )
    out = _exec(node, "--gpu-memory", "2G", "--no-shim", code=code, python=torch_python)
    assert out.returncode == 3, out.stdout + out.stderr


def test_shim_and_mps_together_show_the_cap(node, torch_python):
    code = "import torch; print(torch.cuda.mem_get_info()[1])"
    out = _exec(node, "--gpu-memory", "2G", code=code, python=torch_python)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == 2 * GIB


def test_exec_client_gets_its_compute_and_memory_limits(node, torch_python, record):
    """`mpsd exec --gpu-memory 4G --gpu-compute 25`: the client runs on an MPS server with a
    quarter of the SMs and sees 4 GiB; what the server and its logs say is recorded."""
    full = subprocess.run(
        [torch_python, "-c", "import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert full.returncode == 0, full.stderr
    all_sms = int(full.stdout.split()[-1])
    client = _start(
        node, "--gpu-memory", "4G", "--gpu-compute", "25", code=HOLD.format(nbytes=GIB), python=torch_python
    )
    try:
        line = client.stdout.readline()
        assert line, client.stderr.read()
        seen = json.loads(line)
        control = _control(node)
        servers = control.get_server_list()
        readback = {s: _ask(control, f"get_active_thread_percentage {s}") for s in servers}
        ps = control.ps()
        # the 580 daemon writes its servers' lines into control.log (tagged "Server"), older ones
        # into server.log (docs/hardware.md, 2026-11-26): read both
        server_log = "\n".join(
            (node["logs"] / name).read_text(errors="replace")
            for name in ("server.log", "control.log")
            if (node["logs"] / name).exists()
        )
        over = _exec(
            node,
            "--gpu-memory",
            "4G",
            "--no-shim",
            code="import torch; torch.empty(5 << 30, dtype=torch.uint8, device='cuda')",
            python=torch_python,
        )
    finally:
        stderr = _stop(client)
    interesting = [
        ln for ln in server_log.splitlines()
        if " Server " in ln and ("limit" in ln.lower() or "percentage" in ln.lower())
    ]
    record(
        all_sms=all_sms,
        client=seen,
        servers=servers,
        server_active_thread_percentage=readback,
        ps=[asdict(p) for p in ps],
        server_log_limits=interesting[-10:],
        over_rc=over.returncode,
        over_stderr=over.stderr.strip().splitlines()[-1:],
        client_stderr=stderr,
    )
    assert len(servers) == 1, servers
    assert seen["pid"] in [p.pid for p in ps], ps
    assert seen["total"] == 4 * GIB and seen["props_total"] == 4 * GIB, seen
    assert seen["sms"] <= math.ceil(all_sms * 0.25) + 1 and seen["sms"] < all_sms, (seen, all_sms)
    assert over.returncode != 0, "a 5 GiB allocation passed the MPS server's 4G pinned limit"


def test_status_lists_the_server_and_its_client_with_its_memory(node, torch_python, record):
    client = _start(node, code=HOLD.format(nbytes=GIB), python=torch_python)
    try:
        line = client.stdout.readline()
        assert line, client.stderr.read()
        pid = json.loads(line)["pid"]
        status = subprocess.run(
            [*MPSD, "status", "--json", *node["common"]], capture_output=True, text=True, timeout=60
        )
        table = subprocess.run([*MPSD, "status", *node["common"]], capture_output=True, text=True, timeout=60)
    finally:
        _stop(client)
    record(status_table=table.stdout)
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert data["daemon"] == "up" and len(data["servers"]) == 1, data
    mine = [c for c in data["clients"] if c["pid"] == pid]
    assert mine, data
    assert mine[0]["usedMemory"] is not None and mine[0]["usedMemory"] >= GIB, mine
    assert str(pid) in table.stdout


def test_sigterm_with_a_client_attached_leaves_no_mps_process(node, torch_python, record):
    client = _start(node, code=HOLD.format(nbytes=GIB), python=torch_python)
    try:
        assert client.stdout.readline(), client.stderr.read()
        before = mps_processes(node["pipe"])
        start = time.monotonic()
        node["proc"].send_signal(signal.SIGTERM)
        rc = node["proc"].wait(timeout=90)
        stop_s = time.monotonic() - start
        after = mps_processes(node["pipe"])
    finally:
        stderr = _stop(client)
    record(
        mps_before=before,
        mpsd_rc=rc,
        stop_seconds=round(stop_s, 2),
        mps_after=after,
        client_rc=client.returncode,
        client_stderr=stderr.strip().splitlines()[-3:],
    )
    assert len(before) >= 2, before  # the control daemon and a server
    assert rc == 0
    assert not after, after
